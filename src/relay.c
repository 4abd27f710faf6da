/*-------------------------------------------------------------------------
 *
 * relay.c
 *	  Claim committed events, publish them to Kafka, mark what was
 *	  acknowledged.  One call = one transaction of the relay worker.
 *
 * Why this is at-least-once and keeps per-aggregate order:
 *	- Rows are claimed in id order with FOR UPDATE SKIP LOCKED, and only
 *	  committed rows are visible, so a rolled-back event is never read.
 *	- Each row is produced in that order.  librdkafka's idempotent producer
 *	  keeps each partition in order through its own retries, and one
 *	  aggregate id always maps to one partition (murmur2 on the key).
 *	- A row is marked published only after its delivery report said Kafka
 *	  acknowledged it (acks=all), in the same transaction that claimed it.
 *	  A crash before that commit leaves the row unpublished; it is sent
 *	  again, and consumers drop the duplicate by its "id" header.
 *	- A row whose delivery failed keeps published_at NULL and gets
 *	  attempts + 1, last_error and a backoff.  Later rows of the same
 *	  aggregate are not claimed while it is pending (the NOT EXISTS below),
 *	  so they cannot overtake it on a later attempt.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "relay.h"
#include "snapshot.h"
#include "status.h"
#include "topic.h"

#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_type.h"
#include "common/hashfn.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "nodes/makefuncs.h"
#include "pgstat.h"
#include "postmaster/interrupt.h"
#include "storage/latch.h"
#include "storage/lmgr.h"
#include "storage/procsignal.h"
#include "storage/itemptr.h"
#include "utils/acl.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"
#include "utils/uuid.h"

/* rows fetched from the claim cursor at a time */
#define CLAIM_FETCH_SIZE	256

/*
 * Events larger than this (value and key, bytes) are produced as barriers:
 * later events of the same aggregate wait for the next claim.  Brokers refuse
 * messages by size per topic (max.message.bytes, 1 MiB by default); small
 * events are never refused for it.
 */
#define BARRIER_BYTES	65536

/* first retry of a failed event after this long, doubling up to the cap */
#define RETRY_BACKOFF_BASE_MS	1000

/* rows deleted per retention statement, and statements per cleanup call */
#define CLEANUP_CHUNK		10000
#define CLEANUP_MAX_CHUNKS	10

/*
 * The claim, in three variants (see claim_variant()).
 *
 * An event waits while an earlier failed event of its aggregate cannot be
 * sent yet: it is in its backoff, or (with on_failed_event = hold) marked
 * failed.  A failed event that is due again is claimed with the rest, in id
 * order; produce_row() keeps the order within the batch.  The aggregates
 * that are held back come from events_retry_idx, which is empty while all
 * is well; the NOT IN is planned as one hash table per claim.  Its ORDER BY
 * is that index's order, so that with sorts disabled in the worker it is
 * the index used: with stale statistics the planner would otherwise walk
 * the whole backlog in events_pending_idx for it.
 */
#define CLAIM_SELECT \
"SELECT e.id, e.event_id, e.aggregate_type, e.aggregate_id, e.event_type," \
"       e.topic, e.payload, e.headers, e.created_at, e.attempts, e.ctid" \
"  FROM outbox.events AS e" \
" WHERE e.published_at IS NULL" \
"   AND (e.next_attempt_at IS NULL OR e.next_attempt_at <= pg_catalog.now())"
#define CLAIM_NOT_HELD(held) \
"   AND (e.aggregate_type, e.aggregate_id) NOT IN (" \
"        SELECT b.aggregate_type, b.aggregate_id FROM outbox.events AS b" \
"         WHERE b.published_at IS NULL AND b.attempts > 0 AND " held \
"         ORDER BY b.aggregate_type, b.aggregate_id)"
#define CLAIM_ORDER \
" ORDER BY e.id" \
" LIMIT $1" \
" FOR UPDATE OF e SKIP LOCKED"

typedef enum ClaimVariant
{
	CLAIM_V10,					/* schema 1.0: no dead letters */
	CLAIM_HOLD,					/* failed events hold their aggregate */
	CLAIM_SKIP,					/* failed events are passed by */
	NUM_CLAIM_VARIANTS
} ClaimVariant;

/*
 * From 1.4 on, only row-tracked events (xid NULL) are claimed, and none
 * above $2: the id floor of the snapshot relay's progress while events
 * tracked by snapshot exist.  A row-tracked event above it may have a
 * snapshot-tracked event of its aggregate before it that is committed but
 * not yet published; it waits until the snapshot batches passed its id.
 */
static const char *const claim_sql_legacy[NUM_CLAIM_VARIANTS] = {
	CLAIM_SELECT " AND e.xid IS NULL AND e.id <= $2"
	CLAIM_NOT_HELD("b.next_attempt_at > pg_catalog.now()")
	CLAIM_ORDER,
	CLAIM_SELECT " AND e.failed_at IS NULL AND e.xid IS NULL AND e.id <= $2"
	CLAIM_NOT_HELD("(b.next_attempt_at > pg_catalog.now() OR b.failed_at IS NOT NULL)")
	CLAIM_ORDER,
	CLAIM_SELECT " AND e.failed_at IS NULL AND e.xid IS NULL AND e.id <= $2"
	CLAIM_NOT_HELD("b.next_attempt_at > pg_catalog.now() AND b.failed_at IS NULL")
	CLAIM_ORDER
};

static const char *const claim_sql[NUM_CLAIM_VARIANTS] = {
	CLAIM_SELECT
	CLAIM_NOT_HELD("b.next_attempt_at > pg_catalog.now()")
	CLAIM_ORDER,
	CLAIM_SELECT " AND e.failed_at IS NULL"
	CLAIM_NOT_HELD("(b.next_attempt_at > pg_catalog.now() OR b.failed_at IS NOT NULL)")
	CLAIM_ORDER,
	CLAIM_SELECT " AND e.failed_at IS NULL"
	CLAIM_NOT_HELD("b.next_attempt_at > pg_catalog.now() AND b.failed_at IS NULL")
	CLAIM_ORDER
};

/*
 * Acknowledged rows are found again by their ctid: they are locked by this
 * transaction since the claim, so it cannot have changed, and a TID scan
 * saves an index descent per row.
 */
static const char *const mark_published_sql =
"UPDATE outbox.events SET published_at = $2 WHERE ctid = ANY($1)";

static const char *const delete_published_sql =
"DELETE FROM outbox.events WHERE ctid = ANY($1)";

/*
 * Record failed attempts.  From 1.1 on, permanent failures are counted
 * separately and the one that reaches outbox.max_attempts marks the event
 * failed; RETURNING tells which rows that happened to.
 */
static const char *const mark_failed_sql_v10 =
"UPDATE outbox.events AS e"
"   SET attempts = e.attempts + 1, last_error = f.error, next_attempt_at = f.next_attempt_at"
"  FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]),"
"                  pg_catalog.unnest($2::pg_catalog.text[]),"
"                  pg_catalog.unnest($3::pg_catalog.timestamptz[]),"
"                  pg_catalog.unnest($4::pg_catalog.bool[]))"
"       AS f(id, error, next_attempt_at, permanent)"
" WHERE e.id = f.id"
" RETURNING false";

static const char *const mark_failed_sql =
"UPDATE outbox.events AS e"
"   SET attempts = e.attempts + 1, last_error = f.error, next_attempt_at = f.next_attempt_at,"
"       permanent_failures = e.permanent_failures + f.permanent::pg_catalog.int4,"
"       failed_at = CASE WHEN f.permanent AND e.permanent_failures + 1 >= $5 THEN $6 END"
"  FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]),"
"                  pg_catalog.unnest($2::pg_catalog.text[]),"
"                  pg_catalog.unnest($3::pg_catalog.timestamptz[]),"
"                  pg_catalog.unnest($4::pg_catalog.bool[]))"
"       AS f(id, error, next_attempt_at, permanent)"
" WHERE e.id = f.id"
" RETURNING e.failed_at IS NOT NULL";

/*
 * Retention: look at the CLEANUP_CHUNK oldest published rows (in id order,
 * passing over pending ones) and delete those published before $1.  The
 * array subquery runs once, so the DELETE is a primary-key lookup whatever
 * the planner thinks of the table's size.
 *
 * The scan stops at $3, the highest id this relay has marked published, or
 * at the oldest pending row if that is further: published rows lie below
 * both, and a backlog of pending rows (an outage) above them is never read,
 * however long it grows.  After a restart ($3 = 0) rows published behind a
 * held-back event wait until the relay publishes again.
 */
static const char *const cleanup_sql =
"DELETE FROM outbox.events"
" WHERE id = ANY (ARRAY("
"   SELECT h.id FROM (SELECT id, published_at FROM outbox.events"
"                      WHERE published_at IS NOT NULL"
"                        AND id <= GREATEST($3, COALESCE("
"                              (SELECT min(p.id) FROM outbox.events p"
"                                WHERE p.published_at IS NULL),"
"                              9223372036854775807))"
"                      ORDER BY id LIMIT $2) AS h"
"    WHERE h.published_at < $1))";

/*
 * Retention of 1.4 events: the CLEANUP_CHUNK oldest events the progress
 * snapshot shows published (below its id floor, visible in it), of which
 * those created before $1 are deleted.
 */
static const char *const cleanup_v2_sql =
"DELETE FROM outbox.events"
" WHERE id = ANY (ARRAY("
"   SELECT h.id FROM (SELECT e.id, e.created_at FROM outbox.events AS e"
"                      WHERE e.xid IS NOT NULL"
"                        AND e.id <= (SELECT r.id_floor FROM outbox.relay_progress AS r"
"                                      ORDER BY r.id_floor DESC LIMIT 1)"
"                        AND pg_catalog.pg_visible_in_snapshot(e.xid,"
"                                (SELECT r.snapshot FROM outbox.relay_progress AS r"
"                                  ORDER BY r.id_floor DESC LIMIT 1))"
"                      ORDER BY e.id LIMIT $2) AS h"
"    WHERE h.created_at < $1))";

/*
 * Retention of row-tracked events in 1.4: as cleanup_sql, among the events
 * without xid.  With outbox.relay_mode = snapshot such events are rare, and
 * the scan stops at $3 alone: it must not walk the snapshot-tracked ones.
 */
static const char *const cleanup_rows_sql =
"DELETE FROM outbox.events"
" WHERE id = ANY (ARRAY("
"   SELECT h.id FROM (SELECT id, published_at FROM outbox.events"
"                      WHERE published_at IS NOT NULL AND xid IS NULL"
"                        AND id <= GREATEST($3, COALESCE("
"                              (SELECT min(p.id) FROM outbox.events p"
"                                WHERE p.published_at IS NULL AND p.xid IS NULL),"
"                              9223372036854775807))"
"                      ORDER BY id LIMIT $2) AS h"
"    WHERE h.published_at < $1))";

static const char *const cleanup_rows_bounded_sql =
"DELETE FROM outbox.events"
" WHERE id = ANY (ARRAY("
"   SELECT h.id FROM (SELECT id, published_at FROM outbox.events"
"                      WHERE published_at IS NOT NULL AND xid IS NULL AND id <= $3"
"                      ORDER BY id LIMIT $2) AS h"
"    WHERE h.published_at < $1))";

/*
 * Events that were refused together with others (see mark_results): ids,
 * kept until the event is published or marked failed.  Such an event is
 * produced alone next time, so that a refusal is known to be its own.
 */
static HTAB *suspects = NULL;

/*
 * The last claim of row-tracked events found nothing it could send (all
 * held back): the next call turns to the snapshot batch, so that held rows
 * never starve it.
 */
static bool rows_claimed_nothing = false;

/* highest id marked published by this process; bounds the retention scan */
static int64 highest_published_id = 0;

/* column numbers of claim_sql */
enum
{
	COL_ID = 1,
	COL_EVENT_ID,
	COL_AGGREGATE_TYPE,
	COL_AGGREGATE_ID,
	COL_EVENT_TYPE,
	COL_TOPIC,
	COL_PAYLOAD,
	COL_HEADERS,
	COL_CREATED_AT,
	COL_ATTEMPTS,
	COL_CTID
};

/* what the relay remembers about each claimed row until it is marked */
typedef struct BatchEntry
{
	int64		id;
	ItemPointerData ctid;		/* of the row as claimed (and locked) */
	uint64		aggregate_hash; /* hash of (aggregate_type, aggregate_id) */
	int32		attempts;
	bool		produced;		/* handed to librdkafka */
	bool		held_back;		/* not produced: its aggregate failed earlier
								 * in this batch */
	bool		overtook;		/* acknowledged after an earlier event of its
								 * aggregate failed */
	bool		barrier;		/* produced, but later events of its aggregate
								 * wait for its report (see BARRIER_BYTES) */
	bool		isolated;		/* produced alone: a refusal is its own */
	rd_kafka_resp_err_t error;	/* failure raised before producing */
	char	   *error_text;
} BatchEntry;

/* saved plans, prepared on first use in this worker */
static SPIPlanPtr claim_plans[NUM_CLAIM_VARIANTS];
static SPIPlanPtr claim_plans_legacy[NUM_CLAIM_VARIANTS];
static SPIPlanPtr mark_published_plan = NULL;
static SPIPlanPtr delete_published_plan = NULL;
static SPIPlanPtr mark_failed_plan_v10 = NULL;
static SPIPlanPtr mark_failed_plan = NULL;
static SPIPlanPtr cleanup_plan = NULL;
static SPIPlanPtr cleanup_v2_plan = NULL;
static SPIPlanPtr cleanup_rows_plan = NULL;
static SPIPlanPtr cleanup_rows_bounded_plan = NULL;
static SPIPlanPtr paused_plan = NULL;

static SPIPlanPtr prepare_plan(SPIPlanPtr *cache, const char *sql,
							   int nargs, Oid *argtypes);
static Oid	lock_events_table(void);
static ClaimVariant claim_variant(Oid relid);
static bool relay_is_paused(Oid events_relid);
static void check_can_delete(Oid events_relid);
/* the batch being produced */
typedef struct Batch
{
	BatchEntry *entries;
	int			n;				/* rows claimed so far */
	int			nblocking;		/* rows that failed before producing, were
								 * held back, or are barriers */
	bool		no_isolation;	/* waiting for reports failed: hold back
								 * suspects until the next batch */
	MemoryContext cxt;			/* lives until the batch is marked */
	struct HTAB *held;			/* snapshot batch: aggregates waiting behind
								 * a row-tracked event (snapshot.c), or NULL */
} Batch;

static void produce_row(OutboxProducer *producer, Batch *batch,
						HeapTuple tuple, TupleDesc tupdesc);
static bool is_suspect(int64 id);
static void absorb_barriers(void);
static void set_suspect(int64 id, bool suspect);
static bool wait_for_deliveries(OutboxProducer *producer);
static void check_marked(uint64 changed, int expected, const char *command);
static void mark_results(OutboxProducer *producer, BatchEntry *entries,
						 int n, bool dead_letters, bool by_snapshot,
						 OutboxBatchResult *result);
static int64 timestamptz_to_unix_ms(TimestampTz ts);
static void relay_snapshot_batch(OutboxProducer *producer, Batch *batch,
								 OutboxBatchResult *result);
static bool relay_rows_first(void);
static int	fetch_and_produce(OutboxProducer *producer, Batch *batch,
							  Portal portal, MemoryContext rowcxt);

/*
 * outbox_relay_batch
 *		Run one relay transaction: claim up to outbox.batch_size committed,
 *		unpublished events in id order, produce them, wait for every
 *		delivery report, and mark the acknowledged ones published (or
 *		deleted, with outbox.retention = 0) and the failed ones for retry.
 *
 * Fills *result.  When outbox.events does not exist (extension not created
 * yet, or dropped) it sets result->table_missing and touches nothing: the
 * caller waits and looks again.  Other errors (SPI) are raised as ERROR and
 * handled by the worker's error recovery.
 */
void
outbox_relay_batch(OutboxProducer *producer, OutboxBatchResult *result)
{
	Oid			claim_types[2] = {INT4OID, INT8OID};
	Datum		claim_values[2];
	Portal		portal;
	Batch		batch;
	MemoryContext rowcxt;
	MemoryContext callercxt = CurrentMemoryContext;
	Oid			relid;
	ClaimVariant variant;
	bool		snapshot_schema;

	memset(result, 0, sizeof(*result));
	result->cxt = callercxt;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	PushActiveSnapshot(GetTransactionSnapshot());
	pgstat_report_activity(STATE_RUNNING, "outbox relay: claiming events");

	relid = lock_events_table();
	if (!OidIsValid(relid))
	{
		result->table_missing = true;
		SPI_finish();
		PopActiveSnapshot();
		CommitTransactionCommand();
		pgstat_report_activity(STATE_IDLE, NULL);
		MemoryContextSwitchTo(callercxt);
		return;
	}

	batch.entries = palloc0(sizeof(BatchEntry) * outbox_batch_size);
	batch.n = 0;
	batch.nblocking = 0;
	batch.no_isolation = false;
	batch.cxt = CurrentMemoryContext;
	batch.held = NULL;
	outbox_producer_begin_batch(producer, outbox_batch_size);
	rowcxt = AllocSetContextCreate(CurrentMemoryContext, "outbox relay row",
								   ALLOCSET_DEFAULT_SIZES);

	if (relay_is_paused(relid))
	{
		result->paused = true;
		SPI_finish();
		PopActiveSnapshot();
		CommitTransactionCommand();
		pgstat_report_activity(STATE_IDLE, NULL);
		MemoryContextSwitchTo(callercxt);
		return;
	}

	check_can_delete(relid);
	variant = claim_variant(relid);
	snapshot_schema = outbox_snapshot_schema(relid);
	if (snapshot_schema && !relay_rows_first())
	{
		if (outbox_relay_mode == OUTBOX_RELAY_SNAPSHOT ||
			outbox_snapshot_events_exist())
			relay_snapshot_batch(producer, &batch, result);
		SPI_finish();
		PopActiveSnapshot();
		CommitTransactionCommand();
		pgstat_report_stat(false);
		pgstat_report_activity(STATE_IDLE, NULL);
		MemoryContextSwitchTo(callercxt);
		return;
	}
	claim_values[0] = Int32GetDatum(outbox_batch_size);
	claim_values[1] = Int64GetDatum(snapshot_schema ? outbox_snapshot_claim_ceiling() : 0);
	portal = SPI_cursor_open(NULL,
							 snapshot_schema ?
							 prepare_plan(&claim_plans_legacy[variant],
										  claim_sql_legacy[variant], 2, claim_types) :
							 prepare_plan(&claim_plans[variant], claim_sql[variant],
										  1, claim_types),
							 claim_values, NULL, false);

	/*
	 * From here to the commit, SIGTERM (a fast or smart shutdown, a restart)
	 * must not end the process mid-batch: what Kafka acknowledged would stay
	 * unmarked and be sent again after the restart.  So interrupts are held;
	 * on SIGTERM producing stops, the waits end at once (ProcDiePending is
	 * checked in them), the acknowledged events are marked, and the worker
	 * exits right after the commit.  Nothing in between waits for a lock:
	 * the claim skips locked rows, the marks touch only rows it locked.
	 * What else must not wait for the batch is served in the waits by hand:
	 * the procsignal barriers that DROP DATABASE and others wait for
	 * (absorb_barriers).
	 */
	HOLD_INTERRUPTS();

	/*
	 * Fetch in chunks so that a batch of large payloads never sits in memory
	 * at once: each row is copied into librdkafka's queue (which is bounded,
	 * see producer.c) and its SPI copy freed with the chunk.
	 */
	while (batch.n < outbox_batch_size && !producer->fatal && !ProcDiePending)
	{
		uint64		i;

		SPI_cursor_fetch(portal, true, CLAIM_FETCH_SIZE);
		if (SPI_processed == 0)
			break;
		for (i = 0; i < SPI_processed && batch.n < outbox_batch_size && !ProcDiePending; i++)
		{
			MemoryContext oldcxt;

			oldcxt = MemoryContextSwitchTo(rowcxt);

			produce_row(producer, &batch, SPI_tuptable->vals[i],
						SPI_tuptable->tupdesc);
			batch.n++;
			MemoryContextSwitchTo(oldcxt);
			MemoryContextReset(rowcxt);
		}
		SPI_freetuptable(SPI_tuptable);
	}
	SPI_cursor_close(portal);
	result->claimed = batch.n;
	rows_claimed_nothing = (batch.n == 0);

	if (batch.n > 0)
	{
		pgstat_report_activity(STATE_RUNNING,
							   "outbox relay: waiting for delivery reports");
		if (!wait_for_deliveries(producer))
		{
			/* keep what was acknowledged, give up on the rest for now */
			outbox_producer_abort_batch(producer);
			result->aborted = true;
		}
		mark_results(producer, batch.entries, batch.n, variant != CLAIM_V10,
					 false, result);
	}
	result->fatal = producer->fatal;

	SPI_finish();
	PopActiveSnapshot();
	CommitTransactionCommand();
	RESUME_INTERRUPTS();
	pgstat_report_stat(false);
	pgstat_report_activity(STATE_IDLE, NULL);
	MemoryContextSwitchTo(callercxt);
}

/*
 * Lock outbox.events against a concurrent DROP for the rest of the
 * transaction and return its OID, or InvalidOid if it does not exist.
 * RangeVarGetRelidExtended re-checks after locking, so a table dropped
 * meanwhile is not "found".
 */
static Oid
lock_events_table(void)
{
	RangeVar   *rv = makeRangeVar(OUTBOX_SCHEMA, OUTBOX_EVENTS_TABLE, -1);

	return RangeVarGetRelidExtended(rv, RowExclusiveLock, RVR_MISSING_OK,
									NULL, NULL);
}

/*
 * True if outbox.pause() paused the relay.  Schemas before 1.2 have no
 * outbox.relay table and cannot be paused.
 */
static bool
relay_is_paused(Oid events_relid)
{
	bool		isnull;
	Datum		paused;

	if (!OidIsValid(get_relname_relid("relay", get_rel_namespace(events_relid))))
		return false;
	if (SPI_execute_plan(prepare_plan(&paused_plan, "SELECT paused FROM outbox.relay",
									  0, NULL), NULL, NULL, true, 1) != SPI_OK_SELECT)
		elog(ERROR, "could not read outbox.relay");
	if (SPI_processed == 0)
		return false;
	paused = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
	return !isnull && DatumGetBool(paused);
}

/*
 * With outbox.retention = 0 an acknowledged event is deleted, not marked.
 * A role without DELETE would have every batch sent, then fail to delete
 * it, and send it again after the backoff, over and over: refuse before
 * anything is sent.  (UPDATE needs no such check: the claim's FOR UPDATE
 * fails on its own before a message is produced.)
 */
static void
check_can_delete(Oid events_relid)
{
	if (outbox_retention != 0 ||
		pg_class_aclcheck(events_relid, GetUserId(), ACL_DELETE) == ACLCHECK_OK)
		return;
	ereport(ERROR,
			(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
			 errmsg("permission denied for table events"),
			 errdetail("With outbox.retention = 0 the relay deletes each event once Kafka acknowledged it, so its role \"%s\" needs DELETE on outbox.events. Nothing was sent.",
					   GetUserNameFromId(GetUserId(), false)),
			 errhint("GRANT DELETE ON outbox.events to the relay's role, or set outbox.retention to a positive interval or -1.")));
}

/*
 * Which claim fits the installed schema and settings.  The schema is
 * detected by its columns, so a new library keeps relaying with the old
 * schema until ALTER EXTENSION outbox UPDATE.
 */
static ClaimVariant
claim_variant(Oid relid)
{
	if (get_attnum(relid, "failed_at") == InvalidAttrNumber)
		return CLAIM_V10;
	return outbox_on_failed_event == OUTBOX_ON_FAILED_SKIP ? CLAIM_SKIP : CLAIM_HOLD;
}

static SPIPlanPtr
prepare_plan(SPIPlanPtr *cache, const char *sql, int nargs, Oid *argtypes)
{
	if (*cache == NULL)
	{
		SPIPlanPtr	plan = SPI_prepare(sql, nargs, argtypes);

		if (plan == NULL)
			elog(ERROR, "SPI_prepare failed for \"%s\": %s", sql,
				 SPI_result_code_string(SPI_result));
		SPI_keepplan(plan);
		*cache = plan;
	}
	return *cache;
}

static char *
text_column(HeapTuple tuple, TupleDesc tupdesc, int col, bool *isnull)
{
	Datum		d = SPI_getbinval(tuple, tupdesc, col, isnull);

	return *isnull ? NULL : TextDatumGetCString(d);
}

/*
 * Record a failure that happened before the row reached librdkafka.
 */
static void
entry_failed(Batch *batch, BatchEntry *entry, rd_kafka_resp_err_t err,
			 const char *text)
{
	entry->error = err;
	entry->error_text = MemoryContextStrdup(batch->cxt, text);
	batch->nblocking++;
}

/*
 * Turn one claimed row into a Kafka message and produce it as entry
 * batch->n of the batch.
 *
 * A row is not produced when an earlier row of the same aggregate failed
 * before reaching librdkafka in this batch (held back, to keep order), or
 * when it cannot be produced at all (illegal routed topic, message too
 * large, ...): then entry->error records why.
 */
static void
produce_row(OutboxProducer *producer, Batch *batch, HeapTuple tuple,
			TupleDesc tupdesc)
{
	int			index = batch->n;
	BatchEntry *entry = &batch->entries[index];
	OutboxMessage msg;
	bool		isnull;
	char	   *aggregate_type;
	char	   *aggregate_id;
	char	   *event_type;
	char	   *event_id;
	char	   *topic;
	const char *names[64 + 3];
	const char *values[64 + 3];
	size_t		lens[64 + 3];
	const char **hnames = names;
	const char **hvalues = values;
	size_t	   *hlens = lens;
	int			nheaders = 0;
	Datum		d;
	rd_kafka_resp_err_t err;
	int			i;

	entry->id = DatumGetInt64(SPI_getbinval(tuple, tupdesc, COL_ID, &isnull));
	entry->attempts = DatumGetInt32(SPI_getbinval(tuple, tupdesc, COL_ATTEMPTS,
												  &isnull));
	entry->ctid = *((ItemPointer) DatumGetPointer(SPI_getbinval(tuple, tupdesc, COL_CTID, &isnull)));
	aggregate_type = text_column(tuple, tupdesc, COL_AGGREGATE_TYPE, &isnull);
	aggregate_id = text_column(tuple, tupdesc, COL_AGGREGATE_ID, &isnull);
	entry->aggregate_hash = outbox_aggregate_hash(aggregate_type, aggregate_id);

	/* tracked by snapshot, behind a pending row-tracked event: wait */
	if (batch->held != NULL &&
		hash_search(batch->held, &entry->aggregate_hash, HASH_FIND, NULL) != NULL)
	{
		entry->held_back = true;
		batch->nblocking++;
		return;
	}

	/*
	 * Keep order: once a row of this aggregate failed in this batch, or was
	 * held back, or is a barrier, its later rows wait for the next claim.  A
	 * hash collision only delays an unrelated aggregate by one batch.
	 */
	for (i = 0; batch->nblocking > 0 && i < index; i++)
	{
		BatchEntry *earlier = &batch->entries[i];

		if (earlier->aggregate_hash == entry->aggregate_hash &&
			(earlier->error != RD_KAFKA_RESP_ERR_NO_ERROR || earlier->held_back ||
			 earlier->barrier))
		{
			entry->held_back = true;
			batch->nblocking++;
			return;
		}
	}

	/*
	 * A suspect goes out alone: every message produced before it has its
	 * report first, and it has its own before the next is produced.
	 */
	if (is_suspect(entry->id))
	{
		if (batch->no_isolation || !wait_for_deliveries(producer) || producer->fatal)
		{
			batch->no_isolation = true;
			entry->held_back = true;
			batch->nblocking++;
			return;
		}
		entry->isolated = true;
	}

	event_type = text_column(tuple, tupdesc, COL_EVENT_TYPE, &isnull);
	d = SPI_getbinval(tuple, tupdesc, COL_EVENT_ID, &isnull);
	event_id = DatumGetCString(DirectFunctionCall1(uuid_out, d));

	topic = text_column(tuple, tupdesc, COL_TOPIC, &isnull);
	if (topic == NULL)
		topic = outbox_routed_topic(outbox_topic_prefix, aggregate_type);
	if (!outbox_topic_is_legal(topic, strlen(topic)))
	{
		entry_failed(batch, entry, RD_KAFKA_RESP_ERR_TOPIC_EXCEPTION,
					 psprintf("\"%s\" is not a legal Kafka topic name", topic));
		return;
	}

	msg.topic = topic;
	msg.key = aggregate_id;
	msg.key_len = strlen(aggregate_id);

	d = SPI_getbinval(tuple, tupdesc, COL_PAYLOAD, &isnull);
	if (isnull)
	{
		msg.value = NULL;		/* tombstone */
		msg.value_len = 0;
	}
	else
	{
		Jsonb	   *payload = DatumGetJsonbP(d);

		msg.value = JsonbToCString(NULL, &payload->root, VARSIZE(payload));
		msg.value_len = strlen(msg.value);
	}

	d = SPI_getbinval(tuple, tupdesc, COL_CREATED_AT, &isnull);
	msg.timestamp_ms = timestamptz_to_unix_ms(DatumGetTimestampTz(d));

	/* our headers first, then the user's, in their jsonb (sorted) order */
	d = SPI_getbinval(tuple, tupdesc, COL_HEADERS, &isnull);
	if (!isnull)
	{
		Jsonb	   *headers = DatumGetJsonbP(d);
		int			count = JB_ROOT_IS_OBJECT(headers) ? JB_ROOT_COUNT(headers) : 0;

		if (count > 64)
		{
			hnames = palloc(sizeof(char *) * (count + 3));
			hvalues = palloc(sizeof(char *) * (count + 3));
			hlens = palloc(sizeof(size_t) * (count + 3));
		}
	}
	hnames[nheaders] = OUTBOX_HEADER_ID;
	hvalues[nheaders] = event_id;
	hlens[nheaders++] = strlen(event_id);
	hnames[nheaders] = OUTBOX_HEADER_EVENT_TYPE;
	hvalues[nheaders] = event_type;
	hlens[nheaders++] = strlen(event_type);
	hnames[nheaders] = OUTBOX_HEADER_AGGREGATE_TYPE;
	hvalues[nheaders] = aggregate_type;
	hlens[nheaders++] = strlen(aggregate_type);
	if (!isnull)
	{
		Jsonb	   *headers = DatumGetJsonbP(d);
		JsonbIterator *it = JsonbIteratorInit(&headers->root);
		JsonbValue	v;
		JsonbIteratorToken tok;
		char	   *key = NULL;

		while ((tok = JsonbIteratorNext(&it, &v, true)) != WJB_DONE)
		{
			if (tok == WJB_KEY)
				key = pnstrdup(v.val.string.val, v.val.string.len);
			else if (tok == WJB_VALUE && v.type == jbvString && key != NULL)
			{
				hnames[nheaders] = key;
				hvalues[nheaders] = v.val.string.val;
				hlens[nheaders++] = v.val.string.len;
			}
		}
	}
	msg.nheaders = nheaders;
	msg.header_names = hnames;
	msg.header_values = hvalues;
	msg.header_lens = hlens;

	/* a full local queue is backpressure: serve reports and try again */
	while ((err = outbox_producer_send(producer, index, &msg)) ==
		   RD_KAFKA_RESP_ERR__QUEUE_FULL)
	{
		(void) WaitLatchOrSocket(NULL, WL_SOCKET_READABLE | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
								 producer->wakeup_fd[0], 100,
								 outbox_wait_event(OUTBOX_WAIT_QUEUE_FULL));
		outbox_producer_serve(producer);
		absorb_barriers();
		if (ProcDiePending)
			return;				/* not produced: no verdict, sent again */
	}

	if (err == RD_KAFKA_RESP_ERR_NO_ERROR)
	{
		entry->produced = true;

		/*
		 * A retried event, or a large one, may be refused by the broker.
		 * librdkafka then stops (gapless guarantee), but a later batch of
		 * the same partition may already be on the wire and be written.  So
		 * the rest of this aggregate waits for the next claim, which comes
		 * right after this one; other aggregates are not affected.
		 */
		if (entry->attempts > 0 || msg.value_len + msg.key_len > BARRIER_BYTES)
		{
			entry->barrier = true;
			batch->nblocking++;
		}
		if (entry->isolated)
			(void) wait_for_deliveries(producer);
	}
	else if (err != RD_KAFKA_RESP_ERR__FATAL)
		entry_failed(batch, entry, err, psprintf("%s (%s)", rd_kafka_err2str(err),
												 rd_kafka_err2name(err)));
	/* on _FATAL the row is left alone; the producer is rebuilt */
}

/*
 * Wait until every message of the batch has its delivery report.
 *
 * librdkafka guarantees a report within message.timeout.ms
 * (outbox.delivery_timeout).  We give up earlier only on a fatal producer
 * error, past a safety margin, or when a reload is pending while nothing
 * moves (e.g. new bootstrap servers while the old ones are unreachable).
 * Returns false when the batch should be aborted.
 *
 * A latch set by a committing backend while we wait is not lost: it is set
 * again on return, so the worker goes straight to the next claim.
 */
static bool
wait_for_deliveries(OutboxProducer *producer)
{
	TimestampTz start = GetCurrentTimestamp();
	TimestampTz last_progress = start;
	int			last_outstanding = producer->outstanding;
	bool		woken = false;
	bool		complete = false;

	for (;;)
	{
		TimestampTz now;
		int			rc;

		outbox_producer_serve(producer);
		absorb_barriers();
		if (producer->outstanding <= 0)
		{
			complete = true;
			break;
		}
		if (producer->fatal || ProcDiePending)
			break;
		if (producer->all_brokers_down)
			outbox_enter_state(OUTBOX_STATE_BROKER_DOWN, producer->last_error_text);

		now = GetCurrentTimestamp();
		if (producer->outstanding != last_outstanding)
		{
			last_outstanding = producer->outstanding;
			last_progress = now;
		}
		if (TimestampDifferenceExceeds(start, now, outbox_delivery_timeout + 10000))
			break;
		if (ConfigReloadPending &&
			TimestampDifferenceExceeds(last_progress, now, 1000))
			break;

		rc = WaitLatchOrSocket(MyLatch,
							   WL_LATCH_SET | WL_SOCKET_READABLE | WL_TIMEOUT |
							   WL_EXIT_ON_PM_DEATH,
							   producer->wakeup_fd[0], 100,
							   outbox_wait_event(OUTBOX_WAIT_DELIVERY));
		if (rc & WL_LATCH_SET)
		{
			ResetLatch(MyLatch);
			woken = true;
			CHECK_FOR_INTERRUPTS();
		}
	}
	if (woken)
		SetLatch(MyLatch);
	return complete;
}

static char *
delivery_error_text(rd_kafka_resp_err_t err)
{
	return psprintf("%s (%s)", rd_kafka_err2str(err), rd_kafka_err2name(err));
}

/*
 * Did this row's delivery fail, in a way that counts as an attempt?  A row
 * dropped by us or by a stopped producer (purged, fatal) has no verdict and
 * is simply sent again.
 */
static bool
delivery_failed(const BatchEntry *e, const OutboxDelivery *d)
{
	if (!e->produced)
		return e->error != RD_KAFKA_RESP_ERR_NO_ERROR;
	return d->reported && d->err != RD_KAFKA_RESP_ERR_NO_ERROR &&
		d->err != RD_KAFKA_RESP_ERR__PURGE_QUEUE &&
		d->err != RD_KAFKA_RESP_ERR__PURGE_INFLIGHT &&
		d->err != RD_KAFKA_RESP_ERR__FATAL;
}

/*
 * check_marked
 *		ERROR unless the statement that recorded a batch's outcome changed
 *		every row it was given.
 *
 * The rows are locked by this transaction since the claim, so only a
 * trigger or rule on outbox.events can make the statement skip one.  Going
 * on would leave the row pending and send it again at once, for ever and
 * without a word in the log; the ERROR is logged and retried with backoff,
 * and outbox.status shows it (state error, last_error).
 */
static void
check_marked(uint64 changed, int expected, const char *command)
{
	if (changed != (uint64) expected)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("outbox relay could not record the outcome of %d event(s): its %s changed %llu row(s)",
						expected, command, (unsigned long long) changed),
				 errdetail("Kafka has the events; they stay pending and are sent again when the relay retries."),
				 errhint("Remove triggers and rules on outbox.events that skip or redirect the relay's UPDATE or DELETE.")));
}

/*
 * Apply the delivery reports to the table: acknowledged rows are marked
 * published (or deleted), failed rows get attempts + 1, last_error and a
 * backoff.  Rows without a report (aborted batch, held back, fatal error)
 * are left exactly as they were.
 */
static void
mark_results(OutboxProducer *producer, BatchEntry *entries, int n,
			 bool dead_letters, bool by_snapshot, OutboxBatchResult *result)
{
	Datum	   *published_ids = palloc(sizeof(Datum) * n);
	Datum	   *failed_ids = palloc(sizeof(Datum) * n);
	Datum	   *failed_errors = palloc(sizeof(Datum) * n);
	Datum	   *failed_next = palloc(sizeof(Datum) * n);
	Datum	   *failed_permanent = palloc(sizeof(Datum) * n);
	int			npublished = 0;
	int			nfailed = 0;
	int			nrefused = 0;
	TimestampTz now = GetCurrentTimestamp();
	int			i;

	/*
	 * A broker refuses a partition's whole record batch: when a request
	 * held several messages, each gets the error, though one of them (too
	 * large, too old) may be the cause.  A refusal counts against an event
	 * only when it is known to be its own: it was produced alone, or it was
	 * the only one refused in this batch.  The others are suspects: their
	 * attempt is recorded, without counting it as permanent, and they are
	 * sent again at once, each alone (produce_row).
	 */
	for (i = 0; i < n; i++)
	{
		if (entries[i].produced && delivery_failed(&entries[i], &producer->deliveries[i]) &&
			outbox_kafka_error_is_permanent(producer->deliveries[i].err))
			nrefused++;
	}

	for (i = 0; i < n; i++)
	{
		BatchEntry *e = &entries[i];
		OutboxDelivery *d = &producer->deliveries[i];
		rd_kafka_resp_err_t err = RD_KAFKA_RESP_ERR_NO_ERROR;
		char	   *text = NULL;
		bool		permanent;
		bool		suspect = false;

		if (e->held_back)
		{
			result->held_back++;
			continue;
		}
		if (e->produced && d->reported && d->err == RD_KAFKA_RESP_ERR_NO_ERROR)
		{
			if (by_snapshot)
			{
				/* the progress record says it (relay_snapshot_batch) */
				result->published++;
				continue;
			}
			published_ids[npublished++] = PointerGetDatum(&e->ctid);
			highest_published_id = Max(highest_published_id, e->id);
			if (e->isolated)
				set_suspect(e->id, false);
			continue;
		}
		if (!delivery_failed(e, d))
			continue;			/* no verdict (purged, fatal, aborted before
								 * its report): send it again later */
		if (e->produced)
		{
			err = d->err;
			text = delivery_error_text(err);
		}
		else
		{
			err = e->error;
			text = e->error_text;
		}

		permanent = outbox_kafka_error_is_permanent(err);
		if (permanent && e->produced && !e->isolated && nrefused > 1)
		{
			suspect = true;
			permanent = false;
			result->failed_unattributed++;
		}
		else if (permanent)
			result->failed_permanent++;
		else
			result->failed_transient++;
		if (suspect || permanent)
			set_suspect(e->id, suspect);
		failed_permanent[nfailed] = BoolGetDatum(permanent);
		if (result->first_error == NULL)
			result->first_error = MemoryContextStrdup(result->cxt, text);

		failed_ids[nfailed] = Int64GetDatum(e->id);
		failed_errors[nfailed] = CStringGetTextDatum(text);
		failed_next[nfailed] = suspect ? TimestampTzGetDatum(now) :
			TimestampTzGetDatum(TimestampTzPlusMilliseconds(now,
															Min((int64) outbox_retry_backoff_max,
																(int64) RETRY_BACKOFF_BASE_MS << Min(e->attempts, 20))));
		nfailed++;
	}

	/*
	 * Did a later event of a failed event's aggregate get through anyway?
	 * (It should not: see enable.gapless.guarantee in producer.c.)  Count
	 * each such event once.
	 */
	if (nfailed > 0)
	{
		for (i = 0; i < n; i++)
		{
			if (!delivery_failed(&entries[i], &producer->deliveries[i]))
				continue;
			for (int j = i + 1; j < n; j++)
			{
				if (entries[j].aggregate_hash == entries[i].aggregate_hash &&
					!entries[j].overtook && entries[j].produced &&
					producer->deliveries[j].reported &&
					producer->deliveries[j].err == RD_KAFKA_RESP_ERR_NO_ERROR)
				{
					entries[j].overtook = true;
					result->overtaken++;
				}
			}
		}
	}
	if (!by_snapshot)
		result->published = npublished;

	if (npublished > 0)
	{
		ArrayType  *ids = construct_array(published_ids, npublished, TIDOID,
										  sizeof(ItemPointerData), false, TYPALIGN_SHORT);
		Datum		args[2] = {PointerGetDatum(ids), TimestampTzGetDatum(now)};
		int			ret;

		if (outbox_retention == 0)
		{
			Oid			types[1] = {TIDARRAYOID};

			ret = SPI_execute_plan(prepare_plan(&delete_published_plan,
												delete_published_sql, 1, types),
								   args, NULL, false, 0);
		}
		else
		{
			Oid			types[2] = {TIDARRAYOID, TIMESTAMPTZOID};

			ret = SPI_execute_plan(prepare_plan(&mark_published_plan,
												mark_published_sql, 2, types),
								   args, NULL, false, 0);
		}
		if (ret < 0)
			elog(ERROR, "could not mark events published: %s",
				 SPI_result_code_string(ret));
		check_marked(SPI_processed, npublished,
					 outbox_retention == 0 ? "DELETE" : "UPDATE");
	}

	if (nfailed > 0)
	{
		Oid			types[6] = {INT8ARRAYOID, TEXTARRAYOID, TIMESTAMPTZARRAYOID,
		BOOLARRAYOID, INT4OID, TIMESTAMPTZOID};
		Datum		args[6];
		SPIPlanPtr	plan;
		int			ret;

		args[0] = PointerGetDatum(construct_array(failed_ids, nfailed, INT8OID,
												  sizeof(int64), FLOAT8PASSBYVAL,
												  TYPALIGN_DOUBLE));
		args[1] = PointerGetDatum(construct_array(failed_errors, nfailed, TEXTOID,
												  -1, false, TYPALIGN_INT));
		args[2] = PointerGetDatum(construct_array(failed_next, nfailed, TIMESTAMPTZOID,
												  sizeof(TimestampTz), FLOAT8PASSBYVAL,
												  TYPALIGN_DOUBLE));
		args[3] = PointerGetDatum(construct_array(failed_permanent, nfailed, BOOLOID,
												  sizeof(bool), true, TYPALIGN_CHAR));
		args[4] = Int32GetDatum(outbox_max_attempts);
		args[5] = TimestampTzGetDatum(now);
		if (dead_letters)
			plan = prepare_plan(&mark_failed_plan, mark_failed_sql, 6, types);
		else
			plan = prepare_plan(&mark_failed_plan_v10, mark_failed_sql_v10, 4, types);
		ret = SPI_execute_plan(plan, args, NULL, false, 0);
		if (ret != SPI_OK_UPDATE_RETURNING)
			elog(ERROR, "could not record failed deliveries: %s",
				 SPI_result_code_string(ret));
		check_marked(SPI_processed, nfailed, "UPDATE");
		for (uint64 k = 0; k < SPI_processed; k++)
		{
			bool		isnull;

			if (DatumGetBool(SPI_getbinval(SPI_tuptable->vals[k],
										   SPI_tuptable->tupdesc, 1, &isnull)))
				result->dead_lettered++;
		}
	}
}

/*
 * Run one retention statement (a chunk of at most CLEANUP_CHUNK rows) until
 * it deletes nothing or CLEANUP_MAX_CHUNKS ran; returns the rows deleted.
 */
static int64
cleanup_chunks(SPIPlanPtr *cache, const char *sql, int nargs, Oid *types,
			   Datum *args)
{
	int64		deleted = 0;
	int			chunk;

	for (chunk = 0; chunk < CLEANUP_MAX_CHUNKS; chunk++)
	{
		int			ret = SPI_execute_plan(prepare_plan(cache, sql, nargs, types),
										   args, NULL, false, 0);

		if (ret != SPI_OK_DELETE)
			elog(ERROR, "could not delete published events: %s",
				 SPI_result_code_string(ret));
		deleted += SPI_processed;
		if (SPI_processed == 0)
			break;
		CHECK_FOR_INTERRUPTS();
	}
	return deleted;
}

/*
 * outbox_relay_cleanup
 *		Delete events published more than outbox.retention seconds ago.
 *
 * Runs in its own transaction, in chunks of CLEANUP_CHUNK rows, looking only
 * at the oldest rows of the table (published rows are the oldest), so its
 * cost does not grow with the table.  With retention 0 acknowledged rows
 * are deleted at once by the relay, and this deletes any published while
 * retention was still positive (the new value can arrive with SIGHUP after
 * a batch was marked).  Returns the number of rows deleted; 0 when retention
 * is off (-1) or the table is missing.
 */
int64
outbox_relay_cleanup(void)
{
	int64		deleted = 0;
	Oid			relid;
	MemoryContext callercxt = CurrentMemoryContext;

	if (outbox_retention < 0)
		return 0;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	PushActiveSnapshot(GetTransactionSnapshot());
	pgstat_report_activity(STATE_RUNNING, "outbox relay: deleting published events");

	relid = lock_events_table();
	if (OidIsValid(relid))
	{
		Oid			types[3] = {TIMESTAMPTZOID, INT4OID, INT8OID};
		Datum		args[3];
		bool		v14 = outbox_snapshot_schema(relid);

		args[0] = TimestampTzGetDatum(TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
																  -(int64) outbox_retention * 1000));
		args[1] = Int32GetDatum(CLEANUP_CHUNK);
		args[2] = Int64GetDatum(highest_published_id);

		if (!v14)
			deleted += cleanup_chunks(&cleanup_plan, cleanup_sql, 3, types, args);
		else
		{
			if (outbox_snapshot_events_exist())
				deleted += cleanup_chunks(&cleanup_v2_plan, cleanup_v2_sql, 2,
										  types, args);
			if (outbox_relay_mode == OUTBOX_RELAY_ROW)
				deleted += cleanup_chunks(&cleanup_rows_plan, cleanup_rows_sql, 3,
										  types, args);
			else if (highest_published_id > 0)
				deleted += cleanup_chunks(&cleanup_rows_bounded_plan,
										  cleanup_rows_bounded_sql, 3, types, args);
		}
	}

	SPI_finish();
	PopActiveSnapshot();
	CommitTransactionCommand();
	pgstat_report_stat(false);
	pgstat_report_activity(STATE_IDLE, NULL);
	MemoryContextSwitchTo(callercxt);
	return deleted;
}

/*
 * Absorb pending procsignal barriers while a batch holds interrupts (see
 * outbox_relay_batch): DROP DATABASE of another database, among others,
 * waits until every process has, and must not wait for Kafka.
 */
static void
absorb_barriers(void)
{
	if (ProcSignalBarrierPending)
		ProcessProcSignalBarrier();
}

/*
 * Is this event a suspect (refused together with others, see mark_results)?
 */
static bool
is_suspect(int64 id)
{
	/* called for every claimed row: the set is empty nearly always */
	if (suspects == NULL || hash_get_num_entries(suspects) == 0)
		return false;
	return hash_search(suspects, &id, HASH_FIND, NULL) != NULL;
}

/*
 * Make an event a suspect, or no longer one.  The set lives in
 * TopMemoryContext and only ever holds events refused in a shared request
 * that were not published or marked failed since; a restart forgets it,
 * which costs such an event one more shared attempt that does not count.
 */
static void
set_suspect(int64 id, bool suspect)
{
	if (suspects == NULL)
	{
		HASHCTL		ctl;

		if (!suspect)
			return;
		ctl.keysize = sizeof(int64);
		ctl.entrysize = sizeof(int64);
		ctl.hcxt = TopMemoryContext;
		suspects = hash_create("outbox relay suspects", 64, &ctl,
							   HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	}
	(void) hash_search(suspects, &id, suspect ? HASH_ENTER : HASH_REMOVE, NULL);
}

/* TimestampTz counts microseconds from 2000-01-01; Kafka wants Unix ms */
static int64
timestamptz_to_unix_ms(TimestampTz ts)
{
	return ts / 1000 +
		(int64) (POSTGRES_EPOCH_JDATE - UNIX_EPOCH_JDATE) * SECS_PER_DAY * 1000;
}

/*
 * Fetch every row of portal and produce it, CLAIM_FETCH_SIZE rows at a time,
 * so that a batch of large payloads never sits in memory at once.  Returns
 * the number of rows fetched.
 */
static int
fetch_and_produce(OutboxProducer *producer, Batch *batch, Portal portal,
				  MemoryContext rowcxt)
{
	int			fetched = 0;

	while (batch->n < outbox_batch_size && !producer->fatal && !ProcDiePending)
	{
		uint64		i;

		SPI_cursor_fetch(portal, true, CLAIM_FETCH_SIZE);
		if (SPI_processed == 0)
			break;
		for (i = 0; i < SPI_processed && batch->n < outbox_batch_size && !ProcDiePending; i++)
		{
			MemoryContext oldcxt = MemoryContextSwitchTo(rowcxt);

			produce_row(producer, batch, SPI_tuptable->vals[i],
						SPI_tuptable->tupdesc);
			batch->n++;
			fetched++;
			MemoryContextSwitchTo(oldcxt);
			MemoryContextReset(rowcxt);
		}
		SPI_freetuptable(SPI_tuptable);
	}
	SPI_cursor_close(portal);
	return fetched;
}

/*
 * Relay v2 (schema 1.4): produce the next chunk of the snapshot batch (see
 * snapshot.c) and, when Kafka acknowledged all of it, record the progress.
 * No event row is locked or written.  PROTOTYPE: any failure leaves the
 * progress where it was, and the whole chunk is sent again after the
 * backoff (dead letters and hold/skip are not done yet).
 */
static void
relay_snapshot_batch(OutboxProducer *producer, Batch *batch,
					 OutboxBatchResult *result)
{
	OutboxSnapshotBatch sb;
	MemoryContext rowcxt;
	Datum	   *demote = palloc(sizeof(Datum) * outbox_batch_size);
	int			ndemote = 0;
	int			verdicts;
	bool		part_b = false;
	int			limit;
	int			got;
	int			i;

	rowcxt = AllocSetContextCreate(CurrentMemoryContext, "outbox relay row",
								   ALLOCSET_DEFAULT_SIZES);
	outbox_snapshot_adopt();
	outbox_snapshot_begin(&sb);
	batch->held = outbox_snapshot_held();
	HOLD_INTERRUPTS();
	while (batch->n < outbox_batch_size && !producer->fatal && !ProcDiePending &&
		   !sb.exhausted)
	{
		limit = outbox_batch_size - batch->n;
		got = fetch_and_produce(producer, batch,
								outbox_snapshot_open(&sb, limit, &part_b), rowcxt);
		if (got < limit)
		{
			if (part_b)
				sb.exhausted = true;
			else
				sb.part_a_done = true;
		}
	}
	result->claimed = batch->n;

	if (batch->n > 0)
	{
		pgstat_report_activity(STATE_RUNNING,
							   "outbox relay: waiting for delivery reports");
		if (!wait_for_deliveries(producer))
		{
			outbox_producer_abort_batch(producer);
			result->aborted = true;
		}
	}
	/*
	 * The progress may only cover a prefix of the batch in which every event
	 * has a verdict: acknowledged, or failed (or held back) and handed over
	 * to row tracking.  From the first event without a verdict (aborted
	 * waits, a fatal error, shutdown) on, the chunk is sent again.
	 */
	for (i = 0; i < batch->n; i++)
	{
		BatchEntry *e = &batch->entries[i];
		OutboxDelivery *d = &producer->deliveries[i];

		if (e->produced && d->reported && d->err == RD_KAFKA_RESP_ERR_NO_ERROR)
			continue;
		if (e->held_back || delivery_failed(e, d))
		{
			demote[ndemote++] = Int64GetDatum(e->id);
			continue;
		}
		break;
	}
	verdicts = i;
	if (verdicts < batch->n)
		sb.exhausted = false;
	if (verdicts > 0)
	{
		outbox_snapshot_demote(demote, ndemote);
		mark_results(producer, batch->entries, verdicts, true, true, result);
		sb.from = batch->entries[verdicts - 1].id;
	}
	if (verdicts > 0 || sb.exhausted)
		outbox_snapshot_save(&sb);
	result->fatal = producer->fatal;
	RESUME_INTERRUPTS();
}

/*
 * Should this call claim row-tracked events (schema 1.4)?  Yes when one is
 * due, unless the last such claim found nothing it could send.
 */
static bool
relay_rows_first(void)
{
	bool		rows = !rows_claimed_nothing && outbox_rows_due();

	rows_claimed_nothing = false;
	return rows;
}
