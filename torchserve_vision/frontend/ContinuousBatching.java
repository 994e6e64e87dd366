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
 * Deadlines: a request that can no longer be answered within its deadline (it waited in the queue
 * so long that, with a batch taking as long as this worker's recent ones, its answer would come
 * late) is answered 504, as JSON, when a worker next gathers, and never reaches the worker; once
 * in a batch it gets its answer whatever the time. Waiting up to the deadline itself would be
 * useless: under overload every request computed would then have waited nearly its deadline,
 * and its answer would come just after it. Its
 * deadline is its X-Request-Timeout-Ms header (milliseconds, a positive integer; anything else is
 * a 400 for that request alone), capped by the model's clientTimeoutInMills (the archive's YAML;
 * 0: none), or that alone. TorchServe's own use of clientTimeoutInMills is switched off for the
 * requests gathered here: it drops an expired request without an answer, and drops the answer
 * of a request whose deadline passed while its batch ran. Expired requests are counted in
 * ts_requests_expired_total{model_name, model_version, hostname}.
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
import java.util.Arrays;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.concurrent.LinkedBlockingDeque;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.locks.ReentrantLock;
import org.pytorch.serve.job.GRPCJob;
import org.pytorch.serve.job.Job;
import org.pytorch.serve.metrics.IMetric;
import org.pytorch.serve.metrics.MetricBuilder;
import org.pytorch.serve.util.ConfigManager;
import org.pytorch.serve.util.messages.ModelWorkerResponse;
import org.pytorch.serve.util.messages.Predictions;
import org.pytorch.serve.util.messages.WorkerCommands;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

public class ContinuousBatching extends BatchAggregator {
    private static final Logger logger = LoggerFactory.getLogger(ContinuousBatching.class);
    static final int EXPIRED_STATUS = 504;
    static final int BAD_DEADLINE_STATUS = 400;
    static final String DEADLINE_HEADER = "X-Request-Timeout-Ms";
    static final String EXPIRED_METRIC = "ts_requests_expired_total";
    // Far enough ahead that TorchServe's clientExpireTS (now + this) never passes or overflows.
    static final long NEVER_MS = Long.MAX_VALUE / 4;
    private static IMetric expiredCounter;

    private final ReentrantLock modelLock;
    private final LinkedBlockingDeque<Job> queue;
    private final long modelTimeoutMs;
    private long batchStartNs;          // the running batch's start; 0 when none runs
    private double recentBatchMs;       // moving average of this worker's batch times

    public ContinuousBatching(Model model) {
        super(model);
        modelLock = (ReentrantLock) privateField(model, "lock");
        Map<?, ?> jobsDb = (Map<?, ?>) privateField(model, "jobsDb");
        @SuppressWarnings("unchecked")
        LinkedBlockingDeque<Job> dataQueue =
                (LinkedBlockingDeque<Job>) jobsDb.get(Model.DEFAULT_DATA_QUEUE);
        queue = dataQueue;
        modelTimeoutMs = model.getClientTimeoutInMills();
        logger.info("queued batching for {} (batch size {}, deadline {} ms)",
                model.getModelName(), model.getBatchSize(), modelTimeoutMs);
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
     * it, up to the batch size; requests past their deadline, or with a bad deadline header, are
     * answered on the way and leave no gap. TorchServe's describe job always travels alone. One
     * worker gathers at a time (the model's lock, as in Model.pollBatch). */
    @Override
    public void pollBatch(String threadName, WorkerState state) throws InterruptedException {
        boolean loaded = state == WorkerState.WORKER_MODEL_LOADED;
        if (model.pollMgmtJob(threadName, loaded ? 0 : Long.MAX_VALUE, jobs)) {
            return;
        }
        if (model.isUseJobTicket()) {
            model.incNumJobTickets();
        }
        boolean predictions = false;
        modelLock.lockInterruptibly();
        try {
            while (jobs.size() < model.getBatchSize()) {
                Job next = jobs.isEmpty() ? queue.poll(Long.MAX_VALUE, TimeUnit.MILLISECONDS)
                        : queue.poll();
                if (next == null) {
                    break;
                }
                if (next.getCmd() == WorkerCommands.DESCRIBE) {
                    if (jobs.isEmpty()) {
                        jobs.put(next.getJobId(), next);
                    } else {
                        queue.addFirst(next);
                    }
                    break;
                }
                if (admitted(next)) {
                    jobs.put(next.getJobId(), next);
                    predictions = true;
                }
            }
        } finally {
            modelLock.unlock();
        }
        if (predictions) {
            batchStartNs = System.nanoTime();     // timed until its answers (sendResponse)
        }
    }

    /** Whether `job` joins the batch: not when its deadline header is bad (400) or its deadline
     * has passed (504), each answered here. A job that joins is never dropped by TorchServe. */
    private boolean admitted(Job job) {
        long timeoutMs;
        try {
            timeoutMs = timeoutMs(job.getPayload().getHeaders());
        } catch (IllegalArgumentException e) {
            answer(job, BAD_DEADLINE_STATUS, "InvalidRequestTimeout", e.getMessage());
            return false;
        }
        long waitedMs = (System.nanoTime() - job.getBegin()) / 1_000_000;
        long batchMs = Math.round(recentBatchMs);
        if (timeoutMs > 0 && waitedMs + batchMs >= timeoutMs) {
            answer(job, EXPIRED_STATUS, "DeadlineExceeded", "the request waited " + waitedMs
                    + " ms in the queue and a batch takes about " + batchMs + " ms: it could not"
                    + " be answered within its deadline of " + timeoutMs + " ms, so it was not"
                    + " computed");
            countExpired();
            return false;
        }
        job.getPayload().setClientExpireTS(NEVER_MS);
        return true;
    }

    /** The request's deadline in ms from its arrival (0: none): its header capped by the model's
     * deadline, or the model's. IllegalArgumentException, saying why, for a bad header. */
    private long timeoutMs(Map<String, String> headers) {
        String value = null;
        for (Map.Entry<String, String> header : headers.entrySet()) {
            if (DEADLINE_HEADER.equalsIgnoreCase(header.getKey())) {
                value = header.getValue().trim();
            }
        }
        if (value == null) {
            return modelTimeoutMs;
        }
        long requested;
        try {
            requested = Long.parseLong(value);
        } catch (NumberFormatException e) {
            requested = 0;
        }
        if (requested <= 0 || !value.chars().allMatch(Character::isDigit)) {
            throw new IllegalArgumentException(DEADLINE_HEADER + " must be a positive whole "
                    + "number of milliseconds, got '" + value + "'");
        }
        return modelTimeoutMs > 0 ? Math.min(requested, modelTimeoutMs) : requested;
    }

    /** A JSON error for one request, shaped like the handlers' ({"code", "type", "message"}):
     * HTTP status and body, or for a gRPC client that status's gRPC error. */
    private static void answer(Job job, int status, String type, String message) {
        if (job instanceof GRPCJob) {
            job.sendError(status, message);
            return;
        }
        String body = "{\"code\": " + status + ", \"type\": \"" + type + "\", \"message\": \""
                + message.replace("\\", "\\\\").replace("\"", "\\\"") + "\"}";
        job.response(body.getBytes(StandardCharsets.UTF_8), "application/json", status, null,
                null);
    }

    private void countExpired() {
        IMetric counter = expiredCounter();
        if (counter != null) {
            List<String> labels = Arrays.asList(model.getModelName(), model.getVersion(),
                    ConfigManager.getInstance().getHostName());
            counter.addOrUpdate(labels, 1);
        }
    }

    /** The frontend's counter of expired requests, made once (a Prometheus collector registers
     * its name once per process); null where it cannot be made (logged). */
    private static synchronized IMetric expiredCounter() {
        if (expiredCounter == null) {
            try {
                expiredCounter = MetricBuilder.build(ConfigManager.getInstance().getMetricsMode(),
                        MetricBuilder.MetricType.COUNTER, EXPIRED_METRIC, "Count",
                        Arrays.asList("model_name", "model_version", "hostname"));
            } catch (RuntimeException e) {
                logger.warn("no {} metric: {}", EXPIRED_METRIC, e.toString());
            }
        }
        return expiredCounter;
    }

    /** TorchServe's gRPC jobs send whatever body a request gets as an answer with status OK
     * (GRPCJob.response ignores the per-request status), so a client of its gRPC API could not
     * tell a refused request from an answer. Here a request the handler answered with a status of
     * 400 or more is sent to a gRPC client as that status's gRPC error (INVALID_ARGUMENT for 400,
     * RESOURCE_EXHAUSTED for 413, UNAVAILABLE for 503, as TorchServe maps them), the handler's
     * JSON as its message; HTTP requests keep TorchServe's path (status, headers and body). */
    @Override
    public boolean sendResponse(ModelWorkerResponse message) {
        if (batchStartNs != 0) {
            double batchMs = (System.nanoTime() - batchStartNs) / 1e6;
            recentBatchMs = recentBatchMs == 0 ? batchMs : 0.7 * recentBatchMs + 0.3 * batchMs;
            batchStartNs = 0;
        }
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
