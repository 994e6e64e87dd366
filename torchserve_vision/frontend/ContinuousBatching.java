/*
 * Queued batching for TorchServe 0.12.0's frontend: a batch is whatever is already queued when a
 * worker asks for work (up to the batch size), and nothing waits for company.
 *
 * TorchServe's own batching (Model.pollBatch) takes the first request, then waits up to
 * maxBatchDelay for more, even when every other worker is idle; a delay of 0 caps batches at 2.
 * Here a free worker takes the first request as soon as it arrives and, without waiting, the
 * requests queued behind it. When workers are idle a request runs alone at once; when they are
 * busy, requests queue and the next batch is full: the batch size follows the load by itself,
 * as Triton's dynamic batcher does with no queue delay. maxBatchDelay is not used.
 *
 * This class takes the place of TorchServe's ContinuousBatching (its streaming aggregator, which
 * the frontend picks for an archive whose model-config.yaml says `continuousBatching: true`) when
 * the frontend runs with this project's agent (Agent.java). Everything but gathering a batch, and
 * the status of a refused gRPC request (sendResponse, below), is TorchServe's BatchAggregator:
 * the request sent to the worker, answers, errors, retries.
 * The model's queue and lock are private fields of TorchServe's Model: read once, here, by
 * reflection (TorchServe 0.12.0 is the last release; its Model class will not change).
 */
package org.pytorch.serve.wlm;

import java.lang.reflect.Field;
import java.nio.charset.StandardCharsets;
import java.util.Iterator;
import java.util.Map;
import java.util.concurrent.LinkedBlockingDeque;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.locks.ReentrantLock;
import org.pytorch.serve.job.GRPCJob;
import org.pytorch.serve.job.Job;
import org.pytorch.serve.util.messages.ModelWorkerResponse;
import org.pytorch.serve.util.messages.Predictions;
import org.pytorch.serve.util.messages.WorkerCommands;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

public class ContinuousBatching extends BatchAggregator {
    private static final Logger logger = LoggerFactory.getLogger(ContinuousBatching.class);
    static final int EXPIRED_STATUS = 503;

    private final ReentrantLock modelLock;
    private final LinkedBlockingDeque<Job> queue;

    public ContinuousBatching(Model model) {
        super(model);
        modelLock = (ReentrantLock) privateField(model, "lock");
        Map<?, ?> jobsDb = (Map<?, ?>) privateField(model, "jobsDb");
        @SuppressWarnings("unchecked")
        LinkedBlockingDeque<Job> dataQueue =
                (LinkedBlockingDeque<Job>) jobsDb.get(Model.DEFAULT_DATA_QUEUE);
        queue = dataQueue;
        logger.info("queued batching for {} (batch size {})", model.getModelName(),
                model.getBatchSize());
    }

    private static Object privateField(Model model, String name) {
        try {
            Field field = Model.class.getDeclaredField(name);
            field.setAccessible(true);
            return field.get(model);
        } catch (ReflectiveOperationException e) {
            throw new IllegalStateException(
                    "queued batching needs TorchServe 0.12.0's frontend (Model." + name + ")", e);
        }
    }

    /** The worker's next batch: its own management job if one is waiting (load, unload, scale),
     * else the first queued request (waiting as long as it takes) and the requests queued behind
     * it, up to the batch size. TorchServe's describe job always travels alone. One worker
     * gathers at a time (the model's lock, as in Model.pollBatch). */
    @Override
    public void pollBatch(String threadName, WorkerState state) throws InterruptedException {
        boolean loaded = state == WorkerState.WORKER_MODEL_LOADED;
        if (model.pollMgmtJob(threadName, loaded ? 0 : Long.MAX_VALUE, jobs)) {
            return;
        }
        if (model.isUseJobTicket()) {
            model.incNumJobTickets();
        }
        modelLock.lockInterruptibly();
        try {
            Job first = queue.poll(Long.MAX_VALUE, TimeUnit.MILLISECONDS);
            jobs.put(first.getJobId(), first);
            if (first.getCmd() == WorkerCommands.DESCRIBE) {
                return;
            }
            while (jobs.size() < model.getBatchSize()) {
                Job next = queue.poll();
                if (next == null) {
                    break;
                }
                if (next.getCmd() == WorkerCommands.DESCRIBE) {
                    queue.addFirst(next);
                    break;
                }
                if (next.getPayload().getClientExpireTS() > System.currentTimeMillis()) {
                    jobs.put(next.getJobId(), next);
                } else {
                    // TorchServe drops such a request without an answer; here its client hears.
                    next.sendError(EXPIRED_STATUS,
                            "the request waited in the queue longer than clientTimeoutInMills");
                }
            }
        } finally {
            modelLock.unlock();
        }
    }

    /** TorchServe's gRPC jobs send whatever body a request gets as an answer with status OK
     * (GRPCJob.response ignores the per-request status), so a client of its gRPC API could not
     * tell a refused request from an answer. Here a request the handler answered with a status of
     * 400 or more is sent to a gRPC client as that status's gRPC error (INVALID_ARGUMENT for 400,
     * RESOURCE_EXHAUSTED for 413, UNAVAILABLE for 503, as TorchServe maps them), the handler's
     * JSON as its message; HTTP requests keep TorchServe's path (status, headers and body). */
    @Override
    public boolean sendResponse(ModelWorkerResponse message) {
        if (message.getCode() == 200 && message.getPredictions() != null) {
            Iterator<Predictions> predictions = message.getPredictions().iterator();
            while (predictions.hasNext()) {
                Predictions prediction = predictions.next();
                Job job = jobs.get(prediction.getRequestId());
                if (job instanceof GRPCJob && prediction.getStatusCode() >= 400) {
                    job.sendError(prediction.getStatusCode(),
                            new String(prediction.getResp(), StandardCharsets.UTF_8));
                    predictions.remove();
                }
            }
        }
        return super.sendResponse(message);
    }
}
