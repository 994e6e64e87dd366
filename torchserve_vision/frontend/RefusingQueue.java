/*
 * A model version's queue that answers a request it has no room for itself, saying so.
 *
 * TorchServe 0.12.0 refuses a request at a full queue in its request handlers (ModelManager.addJob
 * returns false, the handler throws ServiceUnavailableException) with the message it also gives a
 * model without workers: "Model ... has no worker to serve inference request. Please use scale
 * workers API to add workers." (pytorch/serve issue 3361), which sends the user looking for a dead
 * worker. ContinuousBatching.java puts this queue in place of the version's own (its `jobsDb`
 * entry, by reflection, once, with the same capacity and the requests already queued) when the
 * version's first worker starts with queued batching. Then a request that finds the queue full is
 * answered here, before TorchServe's handler sees a refusal: 503, `Retry-After`, and a message
 * naming the model, its version and the queue's size (ContinuousBatching.refuseFull), counted in
 * ts_requests_refused_queue_full_total. A version with no worker at all is refused by TorchServe
 * before its queue is asked, with its own message, so the two can be told apart.
 *
 * Retry-After: the seconds the queue ahead takes to be answered at the version's recent pace (its
 * size / (batch size x workers) batches of the recent batch time, which the workers report after
 * every batch), rounded up, at least 1.
 */
package org.pytorch.serve.wlm;

import java.util.Map;
import java.util.concurrent.LinkedBlockingDeque;
import org.pytorch.serve.job.Job;

final class RefusingQueue extends LinkedBlockingDeque<Job> {
    private static final long serialVersionUID = 1L;
    private final transient Model model;
    private final int capacity;
    // The queue this one replaced: a request handler that read it just before the swap may still
    // add to it; what lands there is moved here whenever a worker gathers.
    private final transient LinkedBlockingDeque<Job> replaced;
    private volatile double recentBatchMs;

    private RefusingQueue(Model model, LinkedBlockingDeque<Job> replaced) {
        super(replaced.size() + replaced.remainingCapacity());
        this.model = model;
        this.capacity = replaced.size() + replaced.remainingCapacity();
        this.replaced = replaced;
    }

    /** The version's queue, this class put in its place first if it is not yet. */
    @SuppressWarnings("unchecked")
    static synchronized RefusingQueue installedIn(Model model, Map<?, ?> jobsDb) {
        Object current = jobsDb.get(Model.DEFAULT_DATA_QUEUE);
        if (current instanceof RefusingQueue) {
            return (RefusingQueue) current;
        }
        RefusingQueue queue = new RefusingQueue(model, (LinkedBlockingDeque<Job>) current);
        ((Map<Object, Object>) jobsDb).put(Model.DEFAULT_DATA_QUEUE, queue);
        queue.takeReplaced();
        return queue;
    }

    /** Requests that reached the replaced queue, moved here (oldest first). */
    void takeReplaced() {
        Job job;
        while ((job = replaced.poll()) != null) {
            if (!super.offer(job)) {
                ContinuousBatching.refuseFull(job, model, capacity, retryAfterS());
            }
        }
    }

    /** A worker's batch time, for Retry-After. */
    void batchTook(double batchMs) {
        recentBatchMs = recentBatchMs == 0 ? batchMs : 0.7 * recentBatchMs + 0.3 * batchMs;
    }

    /** Model.addJob's way in: a request that finds no room is answered here and counted as
     * handled, so that TorchServe does not answer it again; its management jobs keep TorchServe's
     * way. */
    @Override
    public boolean offer(Job job) {
        if (super.offer(job)) {
            return true;
        }
        if (job.isControlCmd()) {
            return false;
        }
        ContinuousBatching.refuseFull(job, model, capacity, retryAfterS());
        return true;
    }

    long retryAfterS() {
        int perRound = Math.max(1, model.getBatchSize()) * Math.max(1, model.getMinWorkers());
        double drainMs = Math.ceil((double) size() / perRound) * recentBatchMs;
        return Math.max(1, (long) Math.ceil(drainMs / 1000));
    }
}
