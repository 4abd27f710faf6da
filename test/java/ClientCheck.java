/*
 * ClientCheck: read a topic from the beginning with the Java clients users run, and print one
 * JSON line per record for the integration tests (test/integration/test_26_formats.py) to check.
 *
 *   java -cp '<jars>/*' ClientCheck.java BOOTSTRAP TOPIC COUNT MODE TIMEOUT_S
 *
 * MODE records:     kafka-clients' KafkaConsumer (byte arrays): partition, offset, the partition
 *                   Java's producer computes for the key (Utils.toPositive(Utils.murmur2(key)) %
 *                   partitions, what its default partitioner does for a keyed record), key,
 *                   timestamp and its type, headers in wire order, value (bytes as base64).
 * MODE cloudevents: the same records parsed by the CloudEvents SDK's CloudEventDeserializer
 *                   (io.cloudevents:cloudevents-kafka): specversion, id, type, source, subject,
 *                   time, datacontenttype, data (base64), extension names; or the exception.
 *
 * Stops after COUNT records or TIMEOUT_S seconds, whichever comes first; exit status 0 either
 * way (the test counts the lines).
 */
import io.cloudevents.CloudEvent;
import io.cloudevents.kafka.CloudEventDeserializer;
import java.time.Duration;
import java.util.Base64;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.UUID;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.utils.Utils;

public class ClientCheck {
    public static void main(String[] args) {
        String bootstrap = args[0];
        String topic = args[1];
        int count = Integer.parseInt(args[2]);
        String mode = args[3];
        long deadline = System.currentTimeMillis() + Long.parseLong(args[4]) * 1000;

        Properties props = new Properties();
        props.put("bootstrap.servers", bootstrap);
        props.put("group.id", "outbox-client-check-" + UUID.randomUUID());
        props.put("auto.offset.reset", "earliest");
        props.put("enable.auto.commit", "false");
        CloudEventDeserializer cloudEvents = new CloudEventDeserializer();
        cloudEvents.configure(Map.of(), false);

        try (KafkaConsumer<byte[], byte[]> consumer =
                 new KafkaConsumer<>(props, new ByteArrayDeserializer(), new ByteArrayDeserializer())) {
            int partitions = consumer.partitionsFor(topic).size();
            consumer.subscribe(List.of(topic));
            int seen = 0;
            while (seen < count && System.currentTimeMillis() < deadline) {
                for (ConsumerRecord<byte[], byte[]> r : consumer.poll(Duration.ofMillis(500))) {
                    seen++;
                    System.out.println(mode.equals("cloudevents")
                        ? cloudEvent(cloudEvents, r) : record(r, partitions));
                }
            }
        }
        System.out.flush();
    }

    static String record(ConsumerRecord<byte[], byte[]> r, int partitions) {
        StringBuilder headers = new StringBuilder("[");
        for (Header h : r.headers()) {
            if (headers.length() > 1) headers.append(',');
            headers.append('[').append(str(h.key())).append(',').append(b64(h.value())).append(']');
        }
        headers.append(']');
        Integer javaPartition = r.key() == null ? null
            : Utils.toPositive(Utils.murmur2(r.key())) % partitions;
        return "{\"partition\":" + r.partition() + ",\"offset\":" + r.offset()
            + ",\"java_partition\":" + javaPartition
            + ",\"key\":" + b64(r.key())
            + ",\"timestamp\":" + r.timestamp()
            + ",\"timestamp_type\":" + str(r.timestampType().name)
            + ",\"headers\":" + headers
            + ",\"value\":" + b64(r.value()) + "}";
    }

    static String cloudEvent(CloudEventDeserializer d, ConsumerRecord<byte[], byte[]> r) {
        try {
            CloudEvent e = d.deserialize(r.topic(), r.headers(), r.value());
            return "{\"specversion\":" + str(e.getSpecVersion().toString())
                + ",\"id\":" + str(e.getId())
                + ",\"type\":" + str(e.getType())
                + ",\"source\":" + str(e.getSource() == null ? null : e.getSource().toString())
                + ",\"subject\":" + str(e.getSubject())
                + ",\"time\":" + str(e.getTime() == null ? null : e.getTime().toInstant().toString())
                + ",\"datacontenttype\":" + str(e.getDataContentType())
                + ",\"data\":" + b64(e.getData() == null ? null : e.getData().toBytes())
                + ",\"extensions\":" + str(String.join(",", new java.util.TreeSet<>(e.getExtensionNames())))
                + ",\"key\":" + b64(r.key()) + "}";
        } catch (RuntimeException ex) {
            return "{\"error\":" + str(ex.toString()) + ",\"offset\":" + r.offset() + "}";
        }
    }

    static String b64(byte[] b) {
        return b == null ? "null" : "\"" + Base64.getEncoder().encodeToString(b) + "\"";
    }

    static String str(String s) {
        if (s == null) return "null";
        StringBuilder sb = new StringBuilder("\"");
        for (char c : s.toCharArray()) {
            if (c == '"' || c == '\\') sb.append('\\').append(c);
            else if (c < 0x20 || c > 0x7e) sb.append(String.format("\\u%04x", (int) c));
            else sb.append(c);
        }
        return sb.append('"').toString();
    }
}
