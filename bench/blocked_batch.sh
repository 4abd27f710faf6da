#!/usr/bin/env bash
# A large batch behind one blocking event: does the relay's per-aggregate order check stay linear?
#
# Before issue 27's fix, once a batch held one event that blocks its aggregate (refused before
# producing, held back, a barrier), every later row of the batch looked back over all rows before
# it: quadratic in outbox.batch_size (100,000 after an outage). Now it is one hash lookup per row.
#
# Runs on an already running cluster (test/env/pg.sh + test/env/kafka.sh, PG* variables pointing
# at it, extension installed), like bench/relay_cpu.sh. Two drains, one after the other, each of
# BLOCKED_EVENTS (100,000) events committed while the relay is paused, with outbox.batch_size =
# BLOCKED_BATCH (100,000):
#   clean     the backlog alone
#   blocked   the same backlog behind one event whose topic is not a legal Kafka topic name (it
#             fails before producing, so its aggregate blocks for the rest of the batch)
# Prints each drain's events/s and blocked/clean as a ratio (about 1 when the check is linear).
# Usage: bench/blocked_batch.sh
set -euo pipefail

EVENTS=${BLOCKED_EVENTS:-100000}
BATCH=${BLOCKED_BATCH:-100000}

q() { psql -X -q -At -v ON_ERROR_STOP=1 -c "$1"; }

q "ALTER SYSTEM SET outbox.batch_size = $BATCH" >/dev/null
q "ALTER SYSTEM SET outbox.retention = -1" >/dev/null
q "SELECT pg_reload_conf()" >/dev/null
trap 'q "SELECT outbox.resume()" >/dev/null; q "ALTER SYSTEM RESET outbox.batch_size" >/dev/null;
      q "ALTER SYSTEM RESET outbox.retention" >/dev/null; q "SELECT pg_reload_conf()" >/dev/null' EXIT

drain() { # $1 = clean | blocked: prints the seconds the relay took to publish EVENTS events
    local agg="blocked_$(date +%s%N)" pub0 t0 t1
    q "SELECT outbox.pause()" >/dev/null
    for _ in $(seq 300); do [[ $(q "SELECT state FROM outbox.worker_status()") == paused ]] && break; sleep 0.1; done
    q "DELETE FROM outbox.events" >/dev/null
    psql -X -q -v ON_ERROR_STOP=1 >/dev/null <<SQL
BEGIN;
SELECT pg_current_xact_id();
INSERT INTO outbox.events (aggregate_type, aggregate_id, event_type, payload, topic, xid)
SELECT '$agg', 'blocker', 'bench.blocker', '{}', 'not a legal topic!', pg_current_xact_id()
 WHERE '$1' = 'blocked';
INSERT INTO outbox.events (aggregate_type, aggregate_id, event_type, payload, xid)
SELECT '$agg', (g % 10000)::text, 'bench.event', jsonb_build_object('n', g), pg_current_xact_id()
  FROM generate_series(1, $EVENTS) AS g;
COMMIT;
SQL
    q "ANALYZE outbox.events" >/dev/null
    pub0=$(q "SELECT published FROM outbox.worker_status()")
    t0=$(date +%s.%N)
    q "SELECT outbox.resume()" >/dev/null
    while (( $(q "SELECT published FROM outbox.worker_status()") - pub0 < EVENTS )); do sleep 0.05; done
    t1=$(date +%s.%N)
    q "DELETE FROM outbox.events WHERE aggregate_id = 'blocker'" >/dev/null
    echo "$t1 - $t0" | bc -l
}

clean=$(drain clean)
blocked=$(drain blocked)
printf '| drain of %d events, batch_size %d | seconds | events/s |\n|---|---:|---:|\n' "$EVENTS" "$BATCH"
printf '| clean | %.2f | %.0f |\n' "$clean" "$(echo "$EVENTS / $clean" | bc -l)"
printf '| behind one blocking event | %.2f | %.0f |\n' "$blocked" "$(echo "$EVENTS / $blocked" | bc -l)"
printf '\nblocked / clean = %.2f\n' "$(echo "$blocked / $clean" | bc -l)"
