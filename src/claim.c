/*-------------------------------------------------------------------------
 *
 * claim.c
 *	  Which row-tracked events a relay transaction takes: the claim query in
 *	  its variants for the installed schema and settings (batch.c runs it).
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "claim.h"
#include "relay_xact.h"
#include "snapshot.h"

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
#define CLAIM_ORDER \
" ORDER BY e.id" \
" LIMIT $1" \
" FOR UPDATE OF e SKIP LOCKED"


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

/* saved plans, prepared on first use in this worker */
static SPIPlanPtr claim_plans[NUM_CLAIM_VARIANTS];
static SPIPlanPtr claim_plans_legacy[2][NUM_CLAIM_VARIANTS];	/* [bytes] */

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
 *		table has payload_bytes (1.6).  Raises ERROR if SPI fails.
 */
Portal
outbox_open_claim(ClaimVariant variant, bool snapshot_schema, bool bytes)
{
	Oid			claim_types[2] = {INT4OID, INT8OID};
	Datum		claim_values[2];
	SPIPlanPtr	plan = snapshot_schema ?
		outbox_prepare_bytes_plan(&claim_plans_legacy[bytes][variant],
								  claim_sql_legacy[variant], bytes, 2, claim_types) :
		outbox_prepare_bytes_plan(&claim_plans[variant], claim_sql[variant],
								  false, 1, claim_types);

	claim_values[0] = Int32GetDatum(outbox_batch_size);
	claim_values[1] = Int64GetDatum(snapshot_schema ? outbox_snapshot_claim_ceiling() : 0);
	return SPI_cursor_open(NULL, plan, claim_values, NULL, false);
}
