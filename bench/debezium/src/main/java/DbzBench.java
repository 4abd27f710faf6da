import io.debezium.engine.DebeziumEngine;
import io.debezium.engine.RecordChangeEvent;
import io.debezium.engine.format.ChangeEventFormat;
import io.debezium.embedded.Connect;

import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.serialization.StringSerializer;
import org.apache.kafka.connect.header.Header;
import org.apache.kafka.connect.source.SourceRecord;

import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.Properties;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;

/**
 * Debezium peer for the outbox benchmark (bench/run.sh): the embedded Postgres connector
 * (pgoutput) with the outbox EventRouter, its records produced to Kafka by a KafkaProducer with
 * acks=all and idempotence.  Each batch the engine hands over is produced, every send is
 * awaited (acknowledged by Kafka), and only then are the records marked processed, so the
 * offsets the engine commits never run ahead of Kafka: at-least-once, like Kafka Connect.
 *
 * Usage: java -cp 'target/classes:target/dependency/*' DbzBench run|drain
 *   run    stream until SIGTERM (the shutdown hook closes the engine, which commits offsets)
 *   drain  stream until DBZ_EXPECT records of topic DBZ_TOPIC are acknowledged, print
 *          "DONE <n> <seconds since engine start> <seconds since first record>", exit 0
 * Prints "PROGRESS <seconds> <acked to DBZ_TOPIC> <acked in all>" every second and
 * "STARTED" when the connector task runs.
 *
 * Environment: DBZ_PG_HOST, DBZ_PG_PORT, DBZ_PG_DB, DBZ_PG_USER, DBZ_KAFKA, DBZ_OFFSETS (file),
 * DBZ_SLOT, DBZ_TABLE (schema.table), DBZ_TOPIC, DBZ_EXPECT, DBZ_LINGER_MS (default 1, the
 * relay's default), DBZ_MAX_BATCH (2048), DBZ_MAX_QUEUE (16384), DBZ_POLL_MS (poll.interval.ms,
 * default 500 = Debezium's default: how long the engine waits for a batch to fill).
 */
public class DbzBench {

    static String env(String name, String dflt) {
        String v = System.getenv(name);
        return v == null || v.isEmpty() ? dflt : v;
    }

    public static void main(String[] args) throws Exception {
        final String mode = args.length > 0 ? args[0] : "run";
        if (!mode.equals("run") && !mode.equals("drain")) {
            System.err.println("usage: DbzBench run|drain");
            System.exit(2);
        }
        final String topic = env("DBZ_TOPIC", "");
        final long expect = Long.parseLong(env("DBZ_EXPECT", "0"));

        Properties p = new Properties();
        p.setProperty("name", "dbz-bench");
        p.setProperty("connector.class", "io.debezium.connector.postgresql.PostgresConnector");
        p.setProperty("offset.storage", "org.apache.kafka.connect.storage.FileOffsetBackingStore");
        p.setProperty("offset.storage.file.filename", env("DBZ_OFFSETS", "/tmp/dbz-bench-offsets.dat"));
        p.setProperty("offset.flush.interval.ms", "1000");
        p.setProperty("database.hostname", env("DBZ_PG_HOST", "127.0.0.1"));
        p.setProperty("database.port", env("DBZ_PG_PORT", "5432"));
        p.setProperty("database.user", env("DBZ_PG_USER", "postgres"));
        p.setProperty("database.password", "");
        p.setProperty("database.dbname", env("DBZ_PG_DB", "outbox"));
        p.setProperty("topic.prefix", "dbzbench");
        p.setProperty("plugin.name", "pgoutput");
        p.setProperty("slot.name", env("DBZ_SLOT", "dbz_bench"));
        p.setProperty("slot.drop.on.stop", "false");
        p.setProperty("publication.name", env("DBZ_SLOT", "dbz_bench"));
        p.setProperty("publication.autocreate.mode", "filtered");
        p.setProperty("table.include.list", env("DBZ_TABLE", "public.dbz_outbox"));
        p.setProperty("snapshot.mode", "no_data");
        p.setProperty("tombstones.on.delete", "false");
        p.setProperty("max.batch.size", env("DBZ_MAX_BATCH", "2048"));
        p.setProperty("max.queue.size", env("DBZ_MAX_QUEUE", "16384"));
        p.setProperty("poll.interval.ms", env("DBZ_POLL_MS", "500"));
        p.setProperty("transforms", "outbox");
        p.setProperty("transforms.outbox.type", "io.debezium.transforms.outbox.EventRouter");

        Properties kp = new Properties();
        kp.put("bootstrap.servers", env("DBZ_KAFKA", "127.0.0.1:9092"));
        kp.put("acks", "all");
        kp.put("enable.idempotence", "true");
        kp.put("linger.ms", env("DBZ_LINGER_MS", "1"));
        kp.put("key.serializer", StringSerializer.class.getName());
        kp.put("value.serializer", StringSerializer.class.getName());
        final KafkaProducer<String, String> producer = new KafkaProducer<>(kp);

        final AtomicLong ackedTopic = new AtomicLong();
        final AtomicLong ackedAll = new AtomicLong();
        final AtomicLong firstRecordNanos = new AtomicLong();
        final CountDownLatch done = new CountDownLatch(1);
        final long t0 = System.nanoTime();

        DebeziumEngine<RecordChangeEvent<SourceRecord>> engine = DebeziumEngine
            .create(ChangeEventFormat.of(Connect.class))
            .using(p)
            .using(new DebeziumEngine.ConnectorCallback() {
                @Override
                public void taskStarted() {
                    System.out.println("STARTED");
                    System.out.flush();
                }
            })
            .using((success, message, error) -> {
                if (!success) {
                    System.out.println("ENGINE_FAILED " + message);
                    if (error != null) error.printStackTrace();
                }
                done.countDown();
            })
            .notifying((records, committer) -> {
                if (!records.isEmpty()) firstRecordNanos.compareAndSet(0, System.nanoTime());
                List<Future<RecordMetadata>> acks = new ArrayList<>(records.size());
                List<Boolean> ours = new ArrayList<>(records.size());
                for (RecordChangeEvent<SourceRecord> ev : records) {
                    SourceRecord r = ev.record();
                    if (r.topic() == null || r.topic().startsWith("__debezium")) {
                        continue;
                    }
                    ProducerRecord<String, String> pr = new ProducerRecord<>(r.topic(),
                        r.key() == null ? null : r.key().toString(),
                        r.value() == null ? null : r.value().toString());
                    for (Header h : r.headers()) {
                        if (h.value() != null)
                            pr.headers().add(h.key(), String.valueOf(h.value()).getBytes(StandardCharsets.UTF_8));
                    }
                    acks.add(producer.send(pr));
                    ours.add(r.topic().equals(topic));
                }
                try {
                    for (Future<RecordMetadata> f : acks) f.get();
                } catch (ExecutionException e) {
                    throw new RuntimeException("Kafka refused a record", e.getCause());
                }
                long n = 0;
                for (Boolean b : ours) if (b) n++;
                ackedAll.addAndGet(acks.size());
                ackedTopic.addAndGet(n);
                for (RecordChangeEvent<SourceRecord> ev : records) committer.markProcessed(ev);
                committer.markBatchFinished();
            })
            .build();

        final ExecutorService executor = Executors.newSingleThreadExecutor();
        Runtime.getRuntime().addShutdownHook(new Thread(() -> {
            try {
                engine.close();
                executor.shutdown();
                executor.awaitTermination(30, TimeUnit.SECONDS);
            } catch (Exception e) {
                e.printStackTrace();
            }
            producer.close();
        }));
        executor.execute(engine);

        long lastPrint = System.nanoTime();
        while (done.getCount() > 0) {
            if (mode.equals("drain") && ackedTopic.get() >= expect) {
                long now = System.nanoTime();
                long first = firstRecordNanos.get();
                System.out.printf("DONE %d %.3f %.3f%n", ackedTopic.get(), (now - t0) / 1e9,
                    first == 0 ? 0.0 : (now - first) / 1e9);
                System.out.flush();
                System.exit(0);   // the shutdown hook closes the engine and commits offsets
            }
            if (System.nanoTime() - lastPrint >= 1_000_000_000L) {
                lastPrint = System.nanoTime();
                System.out.printf("PROGRESS %.1f %d %d%n", (lastPrint - t0) / 1e9, ackedTopic.get(), ackedAll.get());
                System.out.flush();
            }
            done.await(10, TimeUnit.MILLISECONDS);
        }
        System.out.println("ENGINE_STOPPED");
        System.exit(mode.equals("drain") ? 1 : 0);
    }
}
