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
 * late) is answered 504, as JSON, when a worker next gathers (every queued request is checked
 * then, not only those taken), and never reaches the worker; once in a batch it gets its answer
 * whatever the time. Its deadline is its X-Request-Timeout-Ms header (milliseconds, a positive
 * integer; anything else is a 400 for that request alone), or else, for an Open Inference
 * Protocol request, its `timeout` parameter (microseconds, as tritonclient sends it, rounded up
 * to whole ms; 0: none; a malformed one is left to the handler, which refuses it), capped by the
 * model's clientTimeoutInMills (the archive's YAML; 0: none), or that alone. While the queue holds more
 * than the workers can answer before the oldest request's deadline (at the recent batch time),
 * batches take the newest requests first (adaptive LIFO): taken in arrival order, every request
 * computed under overload would have waited nearly its deadline and many answers would come just
 * after it; newest first, the answers that are computed come early and the requests that wait
 * longest expire (requests without a deadline never switch the order, so they cannot starve).
 * TorchServe's own use of clientTimeoutInMills is switched off for the requests gathered here:
 * it drops an expired request without an answer, and drops the answer of a request whose
 * deadline passed while its batch ran. Expired requests are counted in
 * ts_requests_expired_total{model_name, model_version, hostname}; every refusal is counted before
 * it is answered, so a client that has its 504 or 503 finds it in the next scrape.
 *
 * Priorities: a request with `X-Request-Priority: high` is taken before every `normal` one (the
 * default; any other value is a 400 for that request alone). While high-priority requests come
 * (one within the last 10 s), half of the queue is kept free for them: the oldest normal
 * requests beyond that are answered 503 with Retry-After, counted in
 * ts_requests_shed_for_priority_total, so that a high-priority request finds room.
 *
 * Requests in a batch: ts_requests_in_batch{model_name, model_version, hostname} is the number
 * of requests workers have taken and not yet answered (a gauge; every version served here has
 * the series from its first worker on). A rollout waits for it, with the queue, before it
 * unregisters the old version (TorchServe's describe shows only the queue). A batch cut short
 * because its worker is stopped goes back to the queue for another worker, as in TorchServe;
 * when the version has no workers left to take it (unregistered, or scaled to none), each of its
 * requests is answered 503 with Retry-After, where TorchServe 0.12 queues them for no one and
 * the clients never get an answer (or a 500 "Worker died.").
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

import com.google.gson.stream.JsonReader;
import com.google.gson.stream.JsonToken;
import java.io.ByteArrayInputStream;
import java.io.IOException;
import java.io.InputStreamReader;
import java.lang.reflect.Field;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.HashMap;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.WeakHashMap;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.locks.ReentrantLock;
import io.prometheus.client.Gauge;
import io.prometheus.client.Histogram;
import org.pytorch.serve.job.GRPCJob;
import org.pytorch.serve.job.Job;
import org.pytorch.serve.metrics.IMetric;
import org.pytorch.serve.metrics.MetricBuilder;
import org.pytorch.serve.util.ConfigManager;
import org.pytorch.serve.util.messages.BaseModelRequest;
import org.pytorch.serve.util.messages.InputParameter;
import org.pytorch.serve.util.messages.ModelLoadModelRequest;
import org.pytorch.serve.util.messages.ModelWorkerResponse;
import org.pytorch.serve.util.messages.Predictions;
import org.pytorch.serve.util.messages.WorkerCommands;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

public class ContinuousBatching extends BatchAggregator {
    private static final Logger logger = LoggerFactory.getLogger(ContinuousBatching.class);
    static final int EXPIRED_STATUS = 504;
    static final int BAD_HEADER_STATUS = 400;
    static final int SHED_STATUS = 503;
    static final String DEADLINE_HEADER = "X-Request-Timeout-Ms";
    static final String PRIORITY_HEADER = "X-Request-Priority";
    static final String V2_JSON_LENGTH_HEADER = "Inference-Header-Content-Length";
    static final String EXPIRED_METRIC = "ts_requests_expired_total";
    static final String SHED_METRIC = "ts_requests_shed_for_priority_total";
    static final String QUEUE_FULL_METRIC = "ts_requests_refused_queue_full_total";
    // How long after the last high-priority request room is still kept for the next.
    static final long PRIORITY_MEMORY_NS = 10_000_000_000L;
    // Far enough ahead that TorchServe's clientExpireTS (now + this) never passes or overflows.
    static final long NEVER_MS = Long.MAX_VALUE / 4;
    private static final Map<String, IMetric> COUNTERS = new HashMap<>();
    static final String LATENCY_METRIC = "ts_request_latency_seconds";
    // Upper bounds (seconds) of the latency histogram's buckets; 0.25 s is the objective of the
    // latency rules in deploy/prometheus/model-monitoring.rules.yml.
    static final double[] LATENCY_BUCKETS_S = {
        0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10,
        30, 60};
    private static Histogram latency;   // made once per process, on the first answer
    static final String IN_BATCH_METRIC = "ts_requests_in_batch";
    private static Gauge inBatch;       // made once per process, by the first worker

    private final ReentrantLock modelLock;
    private final RefusingQueue queue;
    private final long modelTimeoutMs;
    private long batchStartNs;          // the running batch's start; 0 when none runs
    private double recentBatchMs;       // moving average of this worker's batch times
    private final AtomicInteger held = new AtomicInteger();   // requests taken, not yet answered
    private final Gauge.Child inBatchSeries;  // this version's ts_requests_in_batch; null: none
    private long lastHighNs;            // when a high-priority request was last seen queued
    // Each queued request's v2 `timeout` parameter in ms (0: none), read once from its body.
    private final Map<Job, Long> v2TimeoutsMs = Collections.synchronizedMap(new WeakHashMap<>());

    public ContinuousBatching(Model model) {
        super(model);
        modelLock = (ReentrantLock) privateField(model, "lock");
        queue = RefusingQueue.installedIn(model, (Map<?, ?>) privateField(model, "jobsDb"));
        modelTimeoutMs = model.getClientTimeoutInMills();
        Histogram latencies = latencyHistogram();
        if (latencies != null) {    // its series at 0 now: a rate over them counts the first answers
            latencies.labels(model.getModelName(), model.getVersion(),
                    ConfigManager.getInstance().getHostName());
        }
        Gauge taken = inBatchGauge();   // its series at 0 now: present means "counted here"
        inBatchSeries = taken == null ? null : taken.labels(model.getModelName(),
                model.getVersion(), ConfigManager.getInstance().getHostName());
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
     * else, once a request is queued, up to the batch size of what is queued, without waiting.
     * On the way every queued request that can no longer be answered within its deadline is
     * answered 504, and one with a bad header 400 (see the class comment). The batch takes
     * high-priority requests first, then the others; each group oldest first, or newest first
     * while the queue holds more than can be answered before the oldest request's deadline
     * (overload: taken in order, answers would mostly come too late). TorchServe's describe job
     * always travels alone. One worker gathers at a time (the model's lock, as in
     * Model.pollBatch). */
    @Override
    public void pollBatch(String threadName, WorkerState state) throws InterruptedException {
        boolean loaded = state == WorkerState.WORKER_MODEL_LOADED;
        if (model.pollMgmtJob(threadName, loaded ? 0 : Long.MAX_VALUE, jobs)) {
            return;
        }
        if (model.isUseJobTicket()) {
            model.incNumJobTickets();
        }
        release();      // a batch left without an answer call (none expected) is not counted on
        modelLock.lockInterruptibly();
        try {
            while (jobs.isEmpty()) {       // until a request is left that may be computed
                Job first = queue.poll(Long.MAX_VALUE, TimeUnit.MILLISECONDS);   // waits for work
                if (first.getCmd() == WorkerCommands.DESCRIBE) {
                    jobs.put(first.getJobId(), first);
                    return;
                }
                if (!queue.offerFirst(first) && refusal(first, System.nanoTime()) == null) {
                    take(first);   // the queue filled up meanwhile: it is first in any order
                }
                gather();
            }
        } finally {
            modelLock.unlock();
        }
        if (jobs.values().stream().anyMatch(job -> job.getCmd() == WorkerCommands.PREDICT)) {
            batchStartNs = System.nanoTime();     // timed until its answers (sendResponse)
        }
    }

    /** Fills `jobs` from the queue (see pollBatch); answers the requests it refuses. */
    private void gather() {
        queue.takeReplaced();
        long now = System.nanoTime();
        List<Job> high = new ArrayList<>();
        List<Job> normal = new ArrayList<>();
        Job oldest = null;
        for (Iterator<Job> queued = queue.iterator(); queued.hasNext(); ) {
            Job job = queued.next();
            if (job.getCmd() == WorkerCommands.DESCRIBE) {
                if (jobs.isEmpty()) {
                    queued.remove();
                    jobs.put(job.getJobId(), job);
                    return;
                }
                continue;
            }
            String refusal = refusal(job, now);
            if (refusal != null) {
                queued.remove();
                continue;
            }
            oldest = oldest == null ? job : oldest;
            (isHigh(job) ? high : normal).add(job);
        }
        if (!high.isEmpty()) {
            lastHighNs = now;
        }
        boolean newestFirst =
                oldest != null && overloaded(oldest, high.size() + normal.size(), now);
        takeInto(high, newestFirst);
        takeInto(normal, newestFirst);
        if (now - lastHighNs < PRIORITY_MEMORY_NS && lastHighNs != 0) {
            shedForHighPriority(normal);
        }
    }

    /** Takes `candidates` (in arrival order) into the batch until it is full, the newest first
     * when `newestFirst`. */
    private void takeInto(List<Job> candidates, boolean newestFirst) {
        List<Job> order = candidates;
        if (newestFirst) {
            order = new ArrayList<>(candidates);
            Collections.reverse(order);
        }
        for (Job job : order) {
            if (jobs.size() >= model.getBatchSize()) {
                return;
            }
            if (queue.removeFirstOccurrence(job)) {
                take(job);
            }
        }
    }

    /** Joins `job` to the batch; TorchServe then never drops it for its clientTimeoutInMills.
     * Counted in ts_requests_in_batch from here (under the model's lock, as it leaves the queue:
     * a request is always in one of the two) until its batch is answered. */
    private void take(Job job) {
        job.getPayload().setClientExpireTS(NEVER_MS);
        jobs.put(job.getJobId(), job);
        held.incrementAndGet();
        moveInBatch(1);
    }

    /** The batch's requests are answered (or back in the queue): no longer counted. */
    private void release() {
        moveInBatch(-held.getAndSet(0));
    }

    private void moveInBatch(int change) {
        if (inBatchSeries != null && change != 0) {
            inBatchSeries.inc(change);
        }
    }

    /** Answers for a whole batch that failed, or was cut short because its worker was stopped
     * (TorchServe calls this from the worker's thread and from the thread stopping it, hence
     * synchronized). While the version has workers, TorchServe's way: an error for each request,
     * or, for a stopped worker, the batch back in the queue for another. With none left
     * (unregistered, or scaled to none), each request is answered 503 with Retry-After: TorchServe
     * would answer it 500 "Worker died." or queue it where no worker will ever take it. Either
     * way the batch's requests are no longer counted as in a batch. */
    @Override
    public synchronized void sendError(BaseModelRequest message, String error, int status) {
        try {
            if (model.getMaxWorkers() > 0 || message instanceof ModelLoadModelRequest) {
                super.sendError(message, error, status);
            } else {
                answerStopped(error, status);
            }
        } finally {
            release();
        }
    }

    private void answerStopped(String error, int status) {
        String message = "version " + model.getVersion() + " of " + model.getModelName()
                + " was unregistered or scaled to no workers while this request was computed,"
                + " and no worker is left to answer it: send it again";
        for (Job job : new ArrayList<>(jobs.values())) {
            if (job.isControlCmd()) {
                job.sendError(status, error);
            } else {
                respond(job, SHED_STATUS, "ServiceUnavailable", message,
                        Map.of("Retry-After", "1"));
            }
        }
        jobs.clear();
    }

    /** Null when `job` may still be computed; else why not, after answering it: 400 for a bad
     * deadline or priority header, 504 when its answer could no longer come within its deadline
     * (its wait so far plus this worker's recent batch time). */
    private String refusal(Job job, long nowNs) {
        long timeoutMs;
        String badHeader = "InvalidRequestTimeout";
        try {
            timeoutMs = timeoutMs(job);
            badHeader = "InvalidRequestPriority";
            isHigh(job);
        } catch (IllegalArgumentException e) {
            answer(job, BAD_HEADER_STATUS, badHeader, e.getMessage(), null);
            return e.getMessage();
        }
        long waitedMs = (nowNs - job.getBegin()) / 1_000_000;
        long batchMs = Math.round(recentBatchMs);
        if (timeoutMs > 0 && waitedMs + batchMs >= timeoutMs) {
            String message = "the request waited " + waitedMs + " ms in the queue and a batch"
                    + " takes about " + batchMs + " ms: it could not be answered within its"
                    + " deadline of " + timeoutMs + " ms, so it was not computed";
            count(EXPIRED_METRIC);     // before the answer: whoever has it finds it counted
            answer(job, EXPIRED_STATUS, "DeadlineExceeded", message, null);
            return message;
        }
        return null;
    }

    /** Whether the queue holds more than can be answered before the oldest request that can
     * still make its deadline runs out of time: the queue's `waiting` requests take about
     * ceil(waiting / (batch size x workers)) of this worker's recent batch times (a request
     * without a deadline never makes it so). */
    private boolean overloaded(Job oldest, int waiting, long nowNs) {
        long timeoutMs = timeoutMs(oldest);
        int perRound = model.getBatchSize() * Math.max(1, model.getMinWorkers());
        double drainMs = Math.ceil((double) waiting / perRound) * recentBatchMs;
        return timeoutMs > 0 && (nowNs - oldest.getBegin()) / 1e6 + drainMs > timeoutMs;
    }

    /** While high-priority requests come, half of the queue is kept free for them: the
     * oldest normal requests beyond that are answered 503 (with Retry-After) now, instead of a
     * high-priority request being refused at a full queue. */
    private void shedForHighPriority(List<Job> normal) {       // in arrival order
        int capacity = queue.size() + queue.remainingCapacity();
        int reserve = Math.max(1, capacity / 2);
        for (Job job : normal) {
            if (queue.remainingCapacity() >= reserve) {
                return;
            }
            if (queue.removeFirstOccurrence(job)) {
                count(SHED_METRIC);
                answer(job, SHED_STATUS, "ServiceUnavailable", "the server is overloaded and "
                        + "keeps room for high-priority requests (" + PRIORITY_HEADER + ")",
                        Map.of("Retry-After", "1"));
            }
        }
    }

    /** The request's deadline in ms from its arrival (0: none): its header capped by the model's
     * deadline, or the model's. IllegalArgumentException, saying why, for a bad header. */
    private long timeoutMs(Job job) {
        String value = header(job, DEADLINE_HEADER);
        if (value == null) {
            long v2Ms = v2TimeoutsMs.computeIfAbsent(job, ContinuousBatching::v2TimeoutMs);
            if (v2Ms == 0) {
                return modelTimeoutMs;
            }
            return modelTimeoutMs > 0 ? Math.min(v2Ms, modelTimeoutMs) : v2Ms;
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

    /** Whether the request asks for high priority; IllegalArgumentException for a value other
     * than `high` or `normal` (the default). */
    private static boolean isHigh(Job job) {
        String value = header(job, PRIORITY_HEADER);
        if (value == null || "normal".equalsIgnoreCase(value)) {
            return false;
        }
        if ("high".equalsIgnoreCase(value)) {
            return true;
        }
        throw new IllegalArgumentException(PRIORITY_HEADER + " must be 'high' or 'normal', got '"
                + value + "'");
    }

    /** The `timeout` parameter of an Open Inference Protocol request (a JSON body with
     * `inputs`, or the JSON head of the binary extension's body) in ms, rounded up; 0 when the
     * request is not one, gives none, or gives one that is not a whole number >= 0 (the
     * handler refuses that request with a 400). */
    static long v2TimeoutMs(Job job) {
        byte[] body = null;
        for (InputParameter parameter : job.getPayload().getParameters()) {
            if ("body".equals(parameter.getName())) {
                body = parameter.getValue();
            }
        }
        if (body == null) {
            return 0;
        }
        int length = body.length;
        String jsonLength = header(job, V2_JSON_LENGTH_HEADER);
        if (jsonLength != null) {
            try {
                length = Math.min(Integer.parseInt(jsonLength), body.length);
            } catch (NumberFormatException e) {
                return 0;
            }
        }
        return v2TimeoutMs(body, length);
    }

    /** `v2TimeoutMs` of the first `length` bytes of a body. */
    static long v2TimeoutMs(byte[] body, int length) {
        int start = 0;
        while (start < length && Character.isWhitespace(body[start])) {
            start++;
        }
        if (start == length || body[start] != '{') {
            return 0;
        }
        long timeoutUs = 0;
        boolean inputs = false;
        try (JsonReader reader = new JsonReader(new InputStreamReader(
                new ByteArrayInputStream(body, start, length - start), StandardCharsets.UTF_8))) {
            reader.beginObject();
            while (reader.hasNext()) {
                String name = reader.nextName();
                if ("inputs".equals(name)) {
                    inputs = true;
                    reader.skipValue();
                } else if ("parameters".equals(name) && reader.peek() == JsonToken.BEGIN_OBJECT) {
                    timeoutUs = timeoutParameterUs(reader);
                } else {
                    reader.skipValue();
                }
            }
        } catch (IOException | IllegalStateException | NumberFormatException e) {
            return 0;
        }
        return inputs && timeoutUs > 0 ? (timeoutUs + 999) / 1000 : 0;
    }

    private static long timeoutParameterUs(JsonReader reader) throws IOException {
        long timeoutUs = 0;
        reader.beginObject();
        while (reader.hasNext()) {
            if ("timeout".equals(reader.nextName()) && reader.peek() == JsonToken.NUMBER) {
                String number = reader.nextString();
                timeoutUs = number.chars().allMatch(Character::isDigit) ? Long.parseLong(number) : 0;
            } else {
                reader.skipValue();
            }
        }
        reader.endObject();
        return timeoutUs;
    }

    /** A request header's trimmed value (names compared without case); null when absent. */
    private static String header(Job job, String name) {
        String value = null;
        for (Map.Entry<String, String> header : job.getPayload().getHeaders().entrySet()) {
            if (name.equalsIgnoreCase(header.getKey())) {
                value = header.getValue().trim();
            }
        }
        return value;
    }

    /** A JSON error for one request, shaped like the handlers' ({"code", "type", "message"}),
     * with the message as the Open Inference Protocol's `error` too (what tritonclient reads):
     * HTTP status, headers and body, or for a gRPC client that status's gRPC error. The request
     * is marked scheduled first: TorchServe adds its queue time to ts_queue_latency_microseconds
     * when it is answered (unmarked, it would add minus its arrival time). */
    private static void answer(Job job, int status, String type, String message,
            Map<String, String> headers) {
        job.setScheduled();
        respond(job, status, type, message, headers);
    }

    /** `answer` for a request that has left the queue already. */
    private static void respond(Job job, int status, String type, String message,
            Map<String, String> headers) {
        if (job instanceof GRPCJob) {
            job.sendError(status, message);
            return;
        }
        String quoted = "\"" + message.replace("\\", "\\\\").replace("\"", "\\\"") + "\"";
        String body = "{\"code\": " + status + ", \"type\": \"" + type + "\", \"message\": "
                + quoted + ", \"error\": " + quoted + "}";
        job.response(body.getBytes(StandardCharsets.UTF_8), "application/json", status, null,
                headers);
    }

    private void count(String metric) {
        countFor(model, metric);
    }

    private static void countFor(Model model, String metric) {
        IMetric counter = counter(metric);
        if (counter != null) {
            List<String> labels = Arrays.asList(model.getModelName(), model.getVersion(),
                    ConfigManager.getInstance().getHostName());
            counter.addOrUpdate(labels, 1);
        }
    }

    /** A request that found no room in `model`'s queue (RefusingQueue, which says why in
     * `reason`): 503 with Retry-After and a message that says so (TorchServe's would say the
     * model has no worker), counted in ts_requests_refused_queue_full_total; a gRPC request gets
     * that status's gRPC error (UNAVAILABLE) with the message. */
    static void refuseFull(Job job, Model model, String reason, long retryAfterS) {
        String message = "Model \"" + model.getModelName() + "\" version " + model.getVersion()
                + " has a full queue: " + reason + "; retry after " + retryAfterS + " s";
        countFor(model, QUEUE_FULL_METRIC);
        answer(job, SHED_STATUS, "ServiceUnavailableException", message,
                Map.of("Retry-After", Long.toString(retryAfterS)));
    }

    /** The frontend's counter `name`, made once (a Prometheus collector registers its name once
     * per process); null where it cannot be made (logged). */
    private static synchronized IMetric counter(String name) {
        if (!COUNTERS.containsKey(name)) {
            IMetric counter = null;
            try {
                counter = MetricBuilder.build(ConfigManager.getInstance().getMetricsMode(),
                        MetricBuilder.MetricType.COUNTER, name, "Count",
                        Arrays.asList("model_name", "model_version", "hostname"));
            } catch (RuntimeException e) {
                logger.warn("no {} metric: {}", name, e.toString());
            }
            COUNTERS.put(name, counter);
        }
        return COUNTERS.get(name);
    }

    /** The histogram of request latencies, from the request's arrival at the frontend to its
     * answer (what the handler answered, whatever the status; requests this class answers
     * itself, 504 and 503, are not in it): ts_request_latency_seconds{model_name,
     * model_version, hostname}, on the metrics port with metrics_mode=prometheus (TorchServe's
     * own latency metrics are sums, from which no percentile can be had). Null in other
     * metrics modes, or where it cannot be made (logged). */
    private static synchronized Histogram latencyHistogram() {
        if (latency == null && ConfigManager.getInstance().getMetricsMode()
                == MetricBuilder.MetricMode.PROMETHEUS) {
            try {
                latency = Histogram.build().name(LATENCY_METRIC)
                        .help("Request latency, arrival at the frontend to the answer")
                        .labelNames("model_name", "model_version", "hostname")
                        .buckets(LATENCY_BUCKETS_S).register();
            } catch (RuntimeException e) {
                logger.warn("no {} metric: {}", LATENCY_METRIC, e.toString());
            }
        }
        return latency;
    }

    /** The gauge of requests in a batch (see the class comment); null in other metrics modes, or
     * where it cannot be made (logged). */
    private static synchronized Gauge inBatchGauge() {
        if (inBatch == null && ConfigManager.getInstance().getMetricsMode()
                == MetricBuilder.MetricMode.PROMETHEUS) {
            try {
                inBatch = Gauge.build().name(IN_BATCH_METRIC)
                        .help("Requests workers have taken into a batch and not yet answered")
                        .labelNames("model_name", "model_version", "hostname").register();
            } catch (RuntimeException e) {
                logger.warn("no {} metric: {}", IN_BATCH_METRIC, e.toString());
            }
        }
        return inBatch;
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
            queue.batchTook(batchMs);
            batchStartNs = 0;
        }
        if (message.getCode() == 200 && message.getPredictions() != null) {
            Histogram latencies = latencyHistogram();
            Iterator<Predictions> predictions = message.getPredictions().iterator();
            while (predictions.hasNext()) {
                Predictions prediction = predictions.next();
                Job job = jobs.get(prediction.getRequestId());
                if (latencies != null && job != null && job.getCmd() == WorkerCommands.PREDICT) {
                    latencies.labels(model.getModelName(), model.getVersion(),
                            ConfigManager.getInstance().getHostName())
                            .observe((System.nanoTime() - job.getBegin()) / 1e9);
                }
                if (job instanceof GRPCJob && prediction.getStatusCode() >= 400) {
                    job.sendError(prediction.getStatusCode(),
                            new String(prediction.getResp(), StandardCharsets.UTF_8));
                    predictions.remove();
                }
            }
        }
        boolean done = super.sendResponse(message);
        if (done) {
            release();
        }
        return done;
    }
}
