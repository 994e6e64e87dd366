/*
 * A model version's queue that answers a request it has no room for itself, saying so.
 *
 * TorchServe 0.12.0 refuses a request at a full queue in its request handlers (ModelManager.addJob
 * returns false, the handler throws ServiceUnavailableException) with the message it also gives a
 * model without workers: "Model ... has no worker to serve inference request. Please use scale
 * workers API to add workers." (pytorch/serve issue 3361), which sends the user looking for a dead
 * worker. ContinuousBatching.java puts this queue in place of the version's own (its `jobsDb`
 * entry, by reflection, once, with the same capacity and the requests already queued) when the
 * version's first worker starts with queued batching. Then a request that finds no room is
 * answered here, before TorchServe's handler sees a refusal: 503, `Retry-After`, and a message
 * naming the model, its version and why there is no room (ContinuousBatching.refuseFull),
 * counted in ts_requests_refused_queue_full_total. A version with no worker at all is refused by
 * TorchServe before its queue is asked, with its own message, so the two can be told apart.
 *
 * There is no room when the queue holds its capacity (the archive's jobQueueSize, else the
 * server's job_queue_size), or, where the server's config sets `max_queueing_delay_ms`, when the
 * requests ahead of it would take longer than that to be taken at the version's recent pace:
 * ceil(waiting / (batch size x workers)) of its recent batch times (an empty queue never refuses:
 * a free worker takes the request at once). So the queue a version keeps follows what its
 * workers answer on the machine at hand, measured as they serve, and the server's config decides
 * it for every version, whatever an archive says (config/config.production.properties sets it;
 * before a version's first batch only its capacity applies).
 *
 * A refused request is answered after `refusal_hold_ms` (the server's config; 0 or unset: at
 * once), at most HELD_MAX of them held at a time (the others at once): a client that sends again
 * as soon as its 503 arrives then comes back no sooner than that, and closed-loop clients beyond
 * the queue's room cost the frontend a refusal per hold each, not thousands a second.
 *
 * Retry-After: the seconds the queue ahead takes to be answered at the version's recent pace (its
 * size / (batch size x workers) batches of the recent batch time, which the workers report after
 * every batch), rounded up, at least 1.
 */
package org.pytorch.serve.wlm;

import java.util.Map;
import java.util.concurrent.Executors;
import java.util.concurrent.LinkedBlockingDeque;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import org.pytorch.serve.job.Job;
import org.pytorch.serve.util.ConfigManager;

final class RefusingQueue extends LinkedBlockingDeque<Job> {
    private static final long serialVersionUID = 1L;
    static final String MAX_DELAY_KEY = "max_queueing_delay_ms";
    static final String HOLD_KEY = "refusal_hold_ms";
    static final int HELD_MAX = 1000;
    private static final AtomicInteger HELD = new AtomicInteger();
    private static ScheduledExecutorService holds;   // made on the first held refusal
    private final transient Model model;
    private final int capacity;
    private final long maxDelayMs;
    private final long holdMs;
    // The queue this one replaced: a request handler that read it just before the swap may still
    // add to it; what lands there is moved here whenever a worker gathers.
    private final transient LinkedBlockingDeque<Job> replaced;
    private volatile double recentBatchMs;

    private RefusingQueue(Model model, LinkedBlockingDeque<Job> replaced) {
        super(replaced.size() + replaced.remainingCapacity());
        this.model = model;
        this.capacity = replaced.size() + replaced.remainingCapacity();
        this.replaced = replaced;
        this.maxDelayMs = configuredMs(MAX_DELAY_KEY);
        this.holdMs = configuredMs(HOLD_KEY);
    }

    /** A non-negative whole number of ms from the server's config (0 when unset or malformed). */
    static long configuredMs(String key) {
        try {
            return Math.max(0, Long.parseLong(ConfigManager.getInstance().getProperty(key, "0").trim()));
        } catch (NumberFormatException e) {
            return 0;
        }
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
                refuse(job, fullReason());
            }
        }
    }

    /** A worker's batch time, for Retry-After and the delay bound. */
    void batchTook(double batchMs) {
        recentBatchMs = recentBatchMs == 0 ? batchMs : 0.7 * recentBatchMs + 0.3 * batchMs;
    }

    /** Model.addJob's way in: a request that finds no room is answered here and counted as
     * handled, so that TorchServe does not answer it again; its management jobs keep TorchServe's
     * way. */
    @Override
    public boolean offer(Job job) {
        if (job.isControlCmd()) {
            return super.offer(job);
        }
        String tooSlow = delayReason();
        if (tooSlow == null && super.offer(job)) {
            return true;
        }
        refuse(job, tooSlow != null ? tooSlow : fullReason());
        return true;
    }

    /** Why a request arriving now may not wait (it would wait past max_queueing_delay_ms), or
     * null when it may. */
    private String delayReason() {
        double batchMs = recentBatchMs;
        if (maxDelayMs == 0 || batchMs == 0) {
            return null;
        }
        int waiting = size();
        long waitMs = (long) Math.ceil(Math.ceil((double) waiting / perRound()) * batchMs);
        if (waitMs <= maxDelayMs) {
            return null;
        }
        return waiting + " requests are waiting, about " + waitMs + " ms at its recent pace of "
                + Math.round(batchMs) + " ms a batch, over the server's " + MAX_DELAY_KEY + " of "
                + maxDelayMs + " ms";
    }

    private String fullReason() {
        return capacity + " requests are waiting (its job queue size: jobQueueSize in the"
                + " archive's YAML, else job_queue_size)";
    }

    /** The refusal, answered after `refusal_hold_ms` (see the class comment). */
    private void refuse(Job job, String reason) {
        long retryAfterS = retryAfterS();
        if (holdMs == 0 || HELD.incrementAndGet() > HELD_MAX) {
            if (holdMs != 0) {
                HELD.decrementAndGet();
            }
            ContinuousBatching.refuseFull(job, model, reason, retryAfterS);
            return;
        }
        holdExecutor().schedule(() -> {
            try {
                ContinuousBatching.refuseFull(job, model, reason, retryAfterS);
            } finally {
                HELD.decrementAndGet();
            }
        }, holdMs, TimeUnit.MILLISECONDS);
    }

    private static synchronized ScheduledExecutorService holdExecutor() {
        if (holds == null) {
            holds = Executors.newSingleThreadScheduledExecutor(runnable -> {
                Thread thread = new Thread(runnable, "refusal-holds");
                thread.setDaemon(true);
                return thread;
            });
        }
        return holds;
    }

    private int perRound() {
        return Math.max(1, model.getBatchSize()) * Math.max(1, model.getMinWorkers());
    }

    long retryAfterS() {
        double drainMs = Math.ceil((double) size() / perRound()) * recentBatchMs;
        return Math.max(1, (long) Math.ceil(drainMs / 1000));
    }
}
