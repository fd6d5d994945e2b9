package io.fluxjoin.bench;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.HashMap;
import java.util.Map;
import java.util.concurrent.atomic.AtomicBoolean;

import org.apache.flink.api.common.JobStatus;
import org.apache.flink.api.common.eventtime.WatermarkStrategy;
import org.apache.flink.api.common.serialization.SerializationSchema;
import org.apache.flink.api.common.typeinfo.PrimitiveArrayTypeInfo;
import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.api.java.functions.KeySelector;
import org.apache.flink.api.java.tuple.Tuple3;
import org.apache.flink.api.java.tuple.Tuple4;
import org.apache.flink.configuration.CheckpointingOptions;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.configuration.StateBackendOptions;
import org.apache.flink.configuration.StateRecoveryOptions;
import org.apache.flink.connector.base.DeliveryGuarantee;
import org.apache.flink.connector.kafka.sink.KafkaRecordSerializationSchema;
import org.apache.flink.connector.kafka.sink.KafkaSink;
import org.apache.flink.connector.kafka.source.KafkaSource;
import org.apache.flink.connector.kafka.source.KafkaSourceBuilder;
import org.apache.flink.connector.kafka.source.enumerator.initializer.OffsetsInitializer;
import org.apache.flink.connector.kafka.source.reader.deserializer.KafkaRecordDeserializationSchema;
import org.apache.flink.core.execution.CheckpointingMode;
import org.apache.flink.core.execution.JobClient;
import org.apache.flink.core.execution.SavepointFormatType;
import org.apache.flink.streaming.api.datastream.DataStream;
import org.apache.flink.streaming.api.datastream.KeyedStream;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.streaming.api.functions.co.ProcessJoinFunction;
import org.apache.flink.streaming.api.operators.AbstractStreamOperator;
import org.apache.flink.streaming.api.operators.BoundedOneInput;
import org.apache.flink.streaming.api.operators.OneInputStreamOperator;
import org.apache.flink.streaming.runtime.streamrecord.StreamRecord;
import org.apache.flink.util.Collector;
import org.apache.kafka.clients.consumer.ConsumerRecord;

/**
 * The 2-way windowed join of fluxjoin's input topics on Apache Flink, the baseline of `fluxjoin bench
 * peers`: Kafka source, key by key, interval join [-W, +W], Kafka sink in transactions.
 *
 * <p>Arguments (all required): --bootstrap, --left and --right (input topics), --results (topic),
 * --window-ms, --lateness-ms, --bounded (true: read up to the end offsets at the start, then finish),
 * --parallelism, --checkpoint-ms, --checkpoint-dir, --batch (results per Kafka message), --txn-prefix.
 * Optional: --rescale-to N with --rescale-signal (a file) and --savepoint-dir: once the signal file
 * exists, stop with a savepoint and start again from it at parallelism N.
 *
 * <p>Prints `running-ms T` once the job runs, `first-record-ms T` when the first tuple is decoded and `done-ms T` when a bounded job has
 * finished (its last transaction committed): the span between them is the catch-up time, without the
 * JVM's and the MiniCluster's start-up. A rescale prints `stop-ms T` (the savepoint asked for),
 * `stopped-ms T` (the job ended on it) and `restarted-ms T` (the job runs again at N).
 */
public final class IntervalJoinJob {

    /** (id, key, event time ms) of one input tuple. */
    public static final TypeInformation<Tuple3<Long, Long, Long>> TUPLE =
            Types.TUPLE(Types.LONG, Types.LONG, Types.LONG);

    /** A Kafka message's value: one result batch. */
    public static final TypeInformation<byte[]> BYTES = PrimitiveArrayTypeInfo.BYTE_PRIMITIVE_ARRAY_TYPE_INFO;

    private static final int HEADER_BYTES = 16;
    private static final byte VERSION = 1;
    private static final byte KIND_TUPLES = 1;
    private static final byte KIND_RESULTS = 2;
    private static final AtomicBoolean FIRST_RECORD = new AtomicBoolean();
    /** Key groups: fixed, so that a savepoint taken at one parallelism restores at another. */
    private static final int MAX_PARALLELISM = 128;

    private IntervalJoinJob() {}

    public static void main(String[] argv) throws Exception {
        Map<String, String> args = parse(argv);
        int rescaleTo = Integer.parseInt(args.getOrDefault("rescale-to", "0"));
        JobClient job = start(args, Integer.parseInt(args.get("parallelism")), null);
        System.out.println("running-ms " + System.currentTimeMillis());
        if (rescaleTo > 0) {
            // What a Flink user does to rescale: stop with a savepoint, then start the same job from it
            // with the new parallelism. Nothing is read or written from the stop to the restart.
            Path signal = Path.of(args.get("rescale-signal"));
            while (!Files.exists(signal)) {
                Thread.sleep(20);
            }
            System.out.println("stop-ms " + System.currentTimeMillis());
            String savepoint =
                    job.stopWithSavepoint(
                                    false,
                                    "file://" + args.get("savepoint-dir"),
                                    SavepointFormatType.CANONICAL)
                            .get();
            job.getJobExecutionResult().get();
            System.out.println("stopped-ms " + System.currentTimeMillis());
            job = start(args, rescaleTo, savepoint);
            System.out.println("restarted-ms " + System.currentTimeMillis());
        }
        job.getJobExecutionResult().get();
        System.out.println("done-ms " + System.currentTimeMillis());
    }

    /** The job at `parallelism`, from `savepoint` unless it is null, once it runs. */
    private static JobClient start(Map<String, String> args, int parallelism, String savepoint)
            throws Exception {
        long window = Long.parseLong(args.get("window-ms"));
        long lateness = Long.parseLong(args.get("lateness-ms"));
        boolean bounded = Boolean.parseBoolean(args.get("bounded"));

        Configuration conf = new Configuration();
        // State that fits the heap (W = 10 s of tuples): the heap backend, snapshotted asynchronously.
        conf.set(StateBackendOptions.STATE_BACKEND, "hashmap");
        conf.set(CheckpointingOptions.CHECKPOINT_STORAGE, "filesystem");
        conf.set(CheckpointingOptions.CHECKPOINTS_DIRECTORY, "file://" + args.get("checkpoint-dir"));
        conf.set(CheckpointingOptions.CHECKPOINTING_CONSISTENCY_MODE, CheckpointingMode.EXACTLY_ONCE);
        conf.set(
                CheckpointingOptions.CHECKPOINTING_INTERVAL,
                Duration.ofMillis(Long.parseLong(args.get("checkpoint-ms"))));
        if (savepoint != null) {
            conf.set(StateRecoveryOptions.SAVEPOINT_PATH, savepoint);
        }
        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(conf);
        env.setParallelism(parallelism);
        env.setMaxParallelism(MAX_PARALLELISM);

        WatermarkStrategy<Tuple3<Long, Long, Long>> watermarks =
                WatermarkStrategy.<Tuple3<Long, Long, Long>>forBoundedOutOfOrderness(
                                Duration.ofMillis(lateness))
                        .withTimestampAssigner((t, ignored) -> t.f2);
        KeyedStream<Tuple3<Long, Long, Long>, Long> left =
                env.fromSource(source(args, args.get("left"), bounded), watermarks, "left")
                        .uid("left")
                        .keyBy(new ByKey(), Types.LONG);
        KeyedStream<Tuple3<Long, Long, Long>, Long> right =
                env.fromSource(source(args, args.get("right"), bounded), watermarks, "right")
                        .uid("right")
                        .keyBy(new ByKey(), Types.LONG);
        DataStream<byte[]> batches =
                left.intervalJoin(right)
                        .between(Duration.ofMillis(-window), Duration.ofMillis(window))
                        .process(new Pair())
                        .uid("join")
                        .transform(
                                "result batches",
                                BYTES,
                                new ResultBatcher(Integer.parseInt(args.get("batch"))))
                        .uid("result-batches");
        batches.sinkTo(
                        KafkaSink.<byte[]>builder()
                                .setBootstrapServers(args.get("bootstrap"))
                                .setRecordSerializer(
                                        KafkaRecordSerializationSchema.<byte[]>builder()
                                                .setTopic(args.get("results"))
                                                .setValueSerializationSchema(new Identity())
                                                .build())
                                .setDeliveryGuarantee(DeliveryGuarantee.EXACTLY_ONCE)
                                .setTransactionalIdPrefix(args.get("txn-prefix"))
                                // Below the broker's transaction.max.timeout.ms (15 minutes by default).
                                .setProperty("transaction.timeout.ms", "600000")
                                .build())
                .uid("sink");

        JobClient job = env.executeAsync("fluxjoin-flink-baseline");
        JobStatus status = job.getJobStatus().get();
        while (status != JobStatus.RUNNING && !status.isGloballyTerminalState()) {
            Thread.sleep(50);
            status = job.getJobStatus().get();
        }
        return job;
    }

    private static KafkaSource<Tuple3<Long, Long, Long>> source(
            Map<String, String> args, String topic, boolean bounded) {
        KafkaSourceBuilder<Tuple3<Long, Long, Long>> builder =
                KafkaSource.<Tuple3<Long, Long, Long>>builder()
                        .setBootstrapServers(args.get("bootstrap"))
                        .setTopics(topic)
                        .setGroupId(args.get("txn-prefix") + "-" + topic)
                        .setStartingOffsets(OffsetsInitializer.earliest())
                        // The generator writes its input in transactions.
                        .setProperty("isolation.level", "read_committed")
                        .setDeserializer(new TupleBatches());
        return bounded ? builder.setBounded(OffsetsInitializer.latest()).build() : builder.build();
    }

    private static Map<String, String> parse(String[] argv) {
        Map<String, String> args = new HashMap<>();
        for (int i = 0; i + 1 < argv.length; i += 2) {
            if (!argv[i].startsWith("--")) {
                throw new IllegalArgumentException("expected --name value pairs, got " + argv[i]);
            }
            args.put(argv[i].substring(2), argv[i + 1]);
        }
        return args;
    }

    /** fluxjoin's tuple batches (pipeline/codec.py) as tuples; progress records carry none. */
    public static final class TupleBatches
            implements KafkaRecordDeserializationSchema<Tuple3<Long, Long, Long>> {
        @Override
        public void deserialize(
                ConsumerRecord<byte[], byte[]> record, Collector<Tuple3<Long, Long, Long>> out) {
            ByteBuffer buf = ByteBuffer.wrap(record.value()).order(ByteOrder.LITTLE_ENDIAN);
            if (buf.get(0) != VERSION || buf.get(1) != KIND_TUPLES) {
                return; // a progress record
            }
            if (FIRST_RECORD.compareAndSet(false, true)) {
                System.out.println("first-record-ms " + System.currentTimeMillis());
            }
            int n = buf.getInt(4);
            int ids = HEADER_BYTES, keys = ids + 8 * n, times = keys + 8 * n;
            for (int i = 0; i < n; i++) {
                out.collect(Tuple3.of(buf.getLong(ids + 8 * i), buf.getLong(keys + 8 * i), buf.getLong(times + 8 * i)));
            }
        }

        @Override
        public TypeInformation<Tuple3<Long, Long, Long>> getProducedType() {
            return TUPLE;
        }
    }

    /** The join key of a tuple. */
    public static final class ByKey implements KeySelector<Tuple3<Long, Long, Long>, Long> {
        @Override
        public Long getKey(Tuple3<Long, Long, Long> t) {
            return t.f1;
        }
    }

    /** A result: (left id, right id, key, max event time). */
    public static final class Pair
            extends ProcessJoinFunction<
                    Tuple3<Long, Long, Long>, Tuple3<Long, Long, Long>, Tuple4<Long, Long, Long, Long>> {
        @Override
        public void processElement(
                Tuple3<Long, Long, Long> a,
                Tuple3<Long, Long, Long> b,
                Context ctx,
                Collector<Tuple4<Long, Long, Long, Long>> out) {
            out.collect(Tuple4.of(a.f0, b.f0, a.f1, Math.max(a.f2, b.f2)));
        }
    }

    /**
     * Results packed into fluxjoin's result batches of up to `size` results. The buffer is emitted
     * before each checkpoint barrier and at the end of the input, so it never needs to be in a
     * snapshot: every result is in the transaction of the checkpoint after it.
     */
    public static final class ResultBatcher extends AbstractStreamOperator<byte[]>
            implements OneInputStreamOperator<Tuple4<Long, Long, Long, Long>, byte[]>, BoundedOneInput {
        private final int size;
        private transient long[] buffer;
        private transient int count;

        public ResultBatcher(int size) {
            this.size = size;
        }

        @Override
        public void open() throws Exception {
            super.open();
            buffer = new long[4 * size];
        }

        @Override
        public void processElement(StreamRecord<Tuple4<Long, Long, Long, Long>> element) {
            Tuple4<Long, Long, Long, Long> r = element.getValue();
            buffer[count] = r.f0;
            buffer[size + count] = r.f1;
            buffer[2 * size + count] = r.f2;
            buffer[3 * size + count] = r.f3;
            if (++count == size) {
                flush();
            }
        }

        @Override
        public void prepareSnapshotPreBarrier(long checkpointId) {
            flush();
        }

        @Override
        public void endInput() {
            flush();
        }

        private void flush() {
            if (count == 0) {
                return;
            }
            output.collect(new StreamRecord<>(encode(buffer, size, count)));
            count = 0;
        }
    }

    /**
     * A result batch of `n` 2-way results: columns (left ids, right ids, keys, max event times) at
     * `stride` apart in `columns`, written part-major as pipeline/codec.py's encode_results does.
     */
    static byte[] encode(long[] columns, int stride, int n) {
        ByteBuffer out = ByteBuffer.allocate(HEADER_BYTES + 32 * n).order(ByteOrder.LITTLE_ENDIAN);
        out.put(VERSION).put(KIND_RESULTS).putShort((short) 0).putInt(n).putInt(2).putInt(0);
        for (int c = 0; c < 4; c++) {
            for (int i = 0; i < n; i++) {
                out.putLong(columns[c * stride + i]);
            }
        }
        return out.array();
    }

    /** Result batches go to Kafka as they are. */
    public static final class Identity implements SerializationSchema<byte[]> {
        @Override
        public byte[] serialize(byte[] element) {
            return element;
        }
    }
}
