/*-------------------------------------------------------------------------
 *
 * claim.c
 *	  Which row-tracked events a relay transaction takes: the claim query in
 *	  its variants for the installed schema and settings (batch.c runs it).
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "relay/claim.h"
#include "config/guc.h"
#include "relay/relay_xact.h"
#include "shared/partition.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "utils/lsyscache.h"

/*
 * The claim, in three variants (see outbox_claim_variant()).
 *
 * An event waits while an earlier failed event of its aggregate cannot be
 * sent yet: it is in its backoff, or (with on_failed_event = hold) marked
 * failed.  A failed event that is due again is claimed with the rest, in id
 * order; produce_row() (message.c) keeps the order within
 * the batch.  The aggregates
 * that are held back come from events_retry_idx, which is empty while all
 * is well; the NOT IN is planned as one hash table per claim.  Its ORDER BY
 * is that index's order, so that with sorts disabled in the worker it is
 * the index used: with stale statistics the planner would otherwise walk
 * the whole backlog in events_pending_idx for it.
 */
#define CLAIM_SELECT \
"SELECT e.id, e.event_id, e.aggregate_type, e.aggregate_id, e.event_type," \
"       e.topic, e.payload, e.headers, e.created_at, e.attempts, %s, e.ctid" \
"  FROM outbox.events AS e" \
" WHERE e.published_at IS NULL" \
"   AND (e.next_attempt_at IS NULL OR e.next_attempt_at <= pg_catalog.now())"
#define CLAIM_NOT_HELD(held) \
"   AND (e.aggregate_type, e.aggregate_id) NOT IN (" \
"        SELECT b.aggregate_type, b.aggregate_id FROM outbox.events AS b" \
"         WHERE b.published_at IS NULL AND b.attempts > 0 AND " held \
"         ORDER BY b.aggregate_type, b.aggregate_id)"
/*
 * One of k relays of a database claims only the events of its key buckets
 * (partition.c): $3 .. $4.  The hash is of the row's own columns, so the
 * claim still walks events_pending_idx in id order and filters.
 */
#define CLAIM_BUCKETS \
" AND (pg_catalog.hashtextextended(e.aggregate_id," \
"      pg_catalog.hashtextextended(e.aggregate_type, 0)) & 255) BETWEEN $3 AND $4"
#define CLAIM_ORDER \
"%s" \
" ORDER BY e.id" \
" LIMIT $1" \
" FOR UPDATE OF e SKIP LOCKED"


/*
 * From 1.4 on, only row-tracked events (xid NULL) are claimed, and none
 * above the ceiling: the id floor of the snapshot relay's progress while
 * events tracked by snapshot exist.  A row-tracked event above it may have a
 * snapshot-tracked event of its aggregate before it that is committed but
 * not yet published; it waits until the snapshot batches passed its id.
 *
 * The ceiling is part of the claim's own statement, so that it is judged by
 * the claim's snapshot.  Read before (as it was, with the transaction's
 * older snapshot), it missed a snapshot-tracked event committed in between,
 * and the claim then sent a later row-tracked event of its aggregate first.
 * ($2 is unused: the four parameters stay those of every variant.)
 */
#define CLAIM_CEILING \
" AND e.xid IS NULL AND e.id <= (" \
"     SELECT CASE WHEN EXISTS (SELECT 1 FROM outbox.events AS s WHERE s.xid IS NOT NULL)" \
"                 THEN COALESCE(pg_catalog.max(p.id_floor), 0)" \
"                 ELSE 9223372036854775807 END" \
"       FROM outbox.relay_progress AS p)"

static const char *const claim_sql_legacy[NUM_CLAIM_VARIANTS] = {
	CLAIM_SELECT CLAIM_CEILING
	CLAIM_NOT_HELD("b.next_attempt_at > pg_catalog.now()")
	CLAIM_ORDER,
	CLAIM_SELECT " AND e.failed_at IS NULL" CLAIM_CEILING
	CLAIM_NOT_HELD("(b.next_attempt_at > pg_catalog.now() OR b.failed_at IS NOT NULL)")
	CLAIM_ORDER,
	CLAIM_SELECT " AND e.failed_at IS NULL" CLAIM_CEILING
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

/* saved plans, prepared on first use in this worker: [partitioned]... */
static SPIPlanPtr claim_plans[2][NUM_CLAIM_VARIANTS];
static SPIPlanPtr claim_plans_legacy[2][2][NUM_CLAIM_VARIANTS];	/* [bytes] */

/*
 * The saved plan of claim text format, its two %s replaced by the
 * payload_bytes column (or NULL::bytea) and, for one of k relays, the
 * bucket filter.  The parameters are always the four of outbox_open_claim.
 */
static SPIPlanPtr
prepare_claim(SPIPlanPtr *cache, const char *format, bool bytes,
			  bool partitioned)
{
	Oid			types[4] = {INT4OID, INT8OID, INT8OID, INT8OID};

	if (*cache == NULL)
		(void) outbox_prepare_plan(cache,
								   psprintf(format,
											bytes ? "e.payload_bytes" : "NULL::bytea",
											partitioned ? CLAIM_BUCKETS : ""),
								   4, types);
	return *cache;
}

/*
 * outbox_claim_variant
 *		Which claim fits the installed schema and settings of relid
 *		(outbox.events).  The schema is detected by its columns, so a new
 *		library keeps relaying with the old schema until ALTER EXTENSION
 *		outbox UPDATE.
 */
ClaimVariant
outbox_claim_variant(Oid relid)
{
	if (get_attnum(relid, "failed_at") == InvalidAttrNumber)
		return CLAIM_V10;
	return outbox_on_failed_event == OUTBOX_ON_FAILED_SKIP ? CLAIM_SKIP : CLAIM_HOLD;
}

/*
 * outbox_open_claim
 *		Open the claim cursor of up to outbox.batch_size events: the variant
 *		for the schema and settings, and from 1.4 on (snapshot_schema) the
 *		one for row-tracked events below the snapshot progress; bytes: the
 *		table has payload_bytes (1.6).  One of k relays of the database
 *		claims its key buckets only.  Raises ERROR if SPI fails.
 */
Portal
outbox_open_claim(ClaimVariant variant, bool snapshot_schema, bool bytes)
{
	bool		partitioned = outbox_relay_nworkers > 1;
	Datum		claim_values[4];
	SPIPlanPtr	plan = snapshot_schema ?
		prepare_claim(&claim_plans_legacy[partitioned][bytes][variant],
					  claim_sql_legacy[variant], bytes, partitioned) :
		prepare_claim(&claim_plans[partitioned][variant], claim_sql[variant],
					  false, partitioned);

	claim_values[0] = Int32GetDatum(outbox_batch_size);
	claim_values[1] = Int64GetDatum(0);	/* unused: see CLAIM_CEILING */
	claim_values[2] = Int64GetDatum(outbox_bucket_first(outbox_relay_worker,
														outbox_relay_nworkers));
	claim_values[3] = Int64GetDatum(outbox_bucket_first(outbox_relay_worker + 1,
														outbox_relay_nworkers) - 1);
	return SPI_cursor_open(NULL, plan, claim_values, NULL, false);
}
