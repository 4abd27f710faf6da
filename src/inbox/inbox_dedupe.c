/*-------------------------------------------------------------------------
 *
 * inbox_dedupe.c
 *	  The ids of applied events, so that a copy of an event that arrives at
 *	  a later offset is dropped (our relay re-sends a batch after a crash,
 *	  other producers retry).
 *
 * outbox.inbox_seen has two slots, partitions of one table.  An event is
 * applied only if its id is in neither; its id then goes into the current
 * slot, in the transaction that applies it.  Once the current slot has been
 * current for outbox.inbox_dedupe_window, the other slot is emptied with
 * TRUNCATE and becomes current: every id stays at least the window (at
 * most twice it), and no id is ever deleted row by row, so the table makes
 * no dead tuples and needs no vacuum for its retention.
 *
 * A Kafka batch probes both slots for all its ids with one statement and
 * records the ids it applies with another (inbox_batch.c); a retried dead
 * letter does it one id at a time.  The record comes before the apply:
 * should two appliers meet on one id (two workers of a subscription whose
 * producer wrote a copy to another partition, see inbox_offsets.c), the
 * unique index makes the second wait for the first and then skip the id,
 * a duplicate.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "inbox/inbox.h"

#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "storage/lmgr.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

/*
 * how often the worker looks whether the window has passed (ms): once a
 * minute, or four times per window when it is shorter
 */
#define ROTATE_CHECK_MS		60000
#define ROTATE_CHECK_INTERVAL() \
	Min(ROTATE_CHECK_MS, (int64) outbox_inbox_dedupe_window * 250)

static SPIPlanPtr probe_plans[2];
static SPIPlanPtr insert_plans[2];
static SPIPlanPtr seen_many_plan = NULL;
static SPIPlanPtr record_many_plans[2];
static int	current_slot = 0;
static TimestampTz last_rotate_check = 0;

static SPIPlanPtr keep_plan(const char *sql, int nargs, Oid *types);

/*
 * inbox_dedupe_begin_batch
 *		Read which slot is current; call in the apply transaction, with SPI
 *		connected, before any other call here.
 */
void
inbox_dedupe_begin_batch(void)
{
	int			ret;
	bool		isnull;

	ret = SPI_execute("SELECT current_slot FROM outbox.inbox_seen_window", true, 1);
	if (ret != SPI_OK_SELECT || SPI_processed != 1)
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("outbox.inbox_seen_window must have one row")));
	current_slot = DatumGetInt16(SPI_getbinval(SPI_tuptable->vals[0],
											   SPI_tuptable->tupdesc, 1, &isnull)) == 1 ? 1 : 0;
}

/*
 * A plan kept for the worker's life (plancache re-plans it when the
 * extension's tables are re-created).
 */
static SPIPlanPtr
keep_plan(const char *sql, int nargs, Oid *types)
{
	SPIPlanPtr	plan = SPI_prepare(sql, nargs, types);

	if (plan == NULL)
		elog(ERROR, "outbox inbox: could not prepare \"%s\": %s", sql,
			 SPI_result_code_string(SPI_result));
	if (SPI_keepplan(plan) != 0)
		elog(ERROR, "outbox inbox: could not keep the plan of \"%s\"", sql);
	return plan;
}

/* is id in slot of subscription? */
static bool
probe(int slot, const char *subscription, const pg_uuid_t *id)
{
	Datum		values[2];
	int			ret;

	if (probe_plans[slot] == NULL)
	{
		Oid			types[2] = {TEXTOID, UUIDOID};

		probe_plans[slot] = keep_plan(slot == 0 ?
									  "SELECT 1 FROM outbox.inbox_seen_0 WHERE slot = 0 AND subscription = $1 AND event_id = $2" :
									  "SELECT 1 FROM outbox.inbox_seen_1 WHERE slot = 1 AND subscription = $1 AND event_id = $2",
									  2, types);
	}
	values[0] = CStringGetTextDatum(subscription);
	values[1] = UUIDPGetDatum((pg_uuid_t *) id);
	ret = SPI_execute_plan(probe_plans[slot], values, NULL, false, 1);
	if (ret != SPI_OK_SELECT)
		elog(ERROR, "outbox inbox: probing the seen ids failed: %s",
			 SPI_result_code_string(ret));
	return SPI_processed > 0;
}

/*
 * inbox_dedupe_seen
 *		Was the event id applied by subscription within the window?  For
 *		events that will not be applied now (held, failed); does not record.
 */
bool
inbox_dedupe_seen(const char *subscription, const pg_uuid_t *id)
{
	return probe(1 - current_slot, subscription, id) ||
		probe(current_slot, subscription, id);
}

/*
 * inbox_dedupe_record
 *		Record the event id as applied by subscription in the current slot;
 *		false, recording nothing, if it was applied within the window (a
 *		duplicate).  The record rolls back with the transaction.
 */
bool
inbox_dedupe_record(const char *subscription, const pg_uuid_t *id)
{
	Datum		values[2];
	int			ret;
	int			slot = current_slot;

	if (probe(1 - slot, subscription, id))
		return false;
	if (insert_plans[slot] == NULL)
	{
		Oid			types[2] = {TEXTOID, UUIDOID};

		insert_plans[slot] = keep_plan(slot == 0 ?
									   "INSERT INTO outbox.inbox_seen_0 (slot, subscription, event_id) VALUES (0, $1, $2) ON CONFLICT DO NOTHING" :
									   "INSERT INTO outbox.inbox_seen_1 (slot, subscription, event_id) VALUES (1, $1, $2) ON CONFLICT DO NOTHING",
									   2, types);
	}
	values[0] = CStringGetTextDatum(subscription);
	values[1] = UUIDPGetDatum((pg_uuid_t *) id);
	ret = SPI_execute_plan(insert_plans[slot], values, NULL, false, 0);
	if (ret != SPI_OK_INSERT)
		elog(ERROR, "outbox inbox: recording a seen id failed: %s",
			 SPI_result_code_string(ret));
	return SPI_processed == 1;
}

/* a uuid[] Datum of ids[0..n-1] */
static Datum
uuid_array(const pg_uuid_t *ids, int n)
{
	Datum	   *elems = palloc(sizeof(Datum) * Max(n, 1));
	int			i;

	for (i = 0; i < n; i++)
		elems[i] = UUIDPGetDatum((pg_uuid_t *) &ids[i]);
	return PointerGetDatum(construct_array(elems, n, UUIDOID, UUID_LEN, false, TYPALIGN_CHAR));
}

static int
seen_id_cmp(const void *a, const void *b)
{
	return memcmp(a, b, UUID_LEN);
}

/*
 * inbox_dedupe_seen_many
 *		For each of ids[0..n-1], was it applied by subscription within the
 *		window (in either slot)?  Into seen[].  One statement for the batch;
 *		records nothing.
 */
void
inbox_dedupe_seen_many(const char *subscription, const pg_uuid_t *ids, int n,
					   bool *seen)
{
	Datum		values[2];
	int			ret;
	uint64		r;

	memset(seen, 0, sizeof(bool) * n);
	if (n == 0)
		return;
	if (seen_many_plan == NULL)
	{
		Oid			types[2] = {TEXTOID, UUIDARRAYOID};

		/*
		 * Scalar subqueries with LIMIT 1, not EXISTS: the planner may run an
		 * EXISTS under OR as a hashed subplan, which reads every id of the
		 * subscription per batch (the seen tables are insert-only, so their
		 * statistics say "5 rows" for ever).  Measured at 294,000 seen ids:
		 * 158 ms per batch of 500 that way, 2 ms by index probes.
		 */
		seen_many_plan = keep_plan("SELECT u.i::integer FROM pg_catalog.unnest($2) WITH ORDINALITY AS u(id, i)"
								   " WHERE (SELECT true FROM outbox.inbox_seen_0 AS s"
								   "         WHERE s.slot = 0 AND s.subscription = $1 AND s.event_id = u.id LIMIT 1)"
								   "    OR (SELECT true FROM outbox.inbox_seen_1 AS s"
								   "         WHERE s.slot = 1 AND s.subscription = $1 AND s.event_id = u.id LIMIT 1)",
								   2, types);
	}
	values[0] = CStringGetTextDatum(subscription);
	values[1] = uuid_array(ids, n);
	ret = SPI_execute_plan(seen_many_plan, values, NULL, true, 0);
	if (ret != SPI_OK_SELECT)
		elog(ERROR, "outbox inbox: probing the seen ids failed: %s",
			 SPI_result_code_string(ret));
	for (r = 0; r < SPI_processed; r++)
	{
		bool		isnull;
		int			i = DatumGetInt32(SPI_getbinval(SPI_tuptable->vals[r],
													SPI_tuptable->tupdesc, 1, &isnull));

		if (i >= 1 && i <= n)
			seen[i - 1] = true;
	}
}

/*
 * inbox_dedupe_record_many
 *		Record ids[0..n-1] (distinct) as applied by subscription in the
 *		current slot, with one statement; recorded[i] false for an id some
 *		other transaction recorded first (it waited for it to commit: a
 *		duplicate, not to be applied).  Rolls back with the transaction.
 */
void
inbox_dedupe_record_many(const char *subscription, const pg_uuid_t *ids, int n,
						 bool *recorded)
{
	Datum		values[2];
	int			ret;
	int			slot = current_slot;
	pg_uuid_t  *got;
	uint64		r;
	int			i;

	memset(recorded, 0, sizeof(bool) * n);
	if (n == 0)
		return;
	if (record_many_plans[slot] == NULL)
	{
		Oid			types[2] = {TEXTOID, UUIDARRAYOID};

		record_many_plans[slot] = keep_plan(slot == 0 ?
											"INSERT INTO outbox.inbox_seen_0 (slot, subscription, event_id)"
											" SELECT 0, $1, u.id FROM pg_catalog.unnest($2) AS u(id)"
											" ON CONFLICT DO NOTHING RETURNING event_id" :
											"INSERT INTO outbox.inbox_seen_1 (slot, subscription, event_id)"
											" SELECT 1, $1, u.id FROM pg_catalog.unnest($2) AS u(id)"
											" ON CONFLICT DO NOTHING RETURNING event_id",
											2, types);
	}
	values[0] = CStringGetTextDatum(subscription);
	values[1] = uuid_array(ids, n);
	ret = SPI_execute_plan(record_many_plans[slot], values, NULL, false, 0);
	if (ret != SPI_OK_INSERT_RETURNING)
		elog(ERROR, "outbox inbox: recording seen ids failed: %s",
			 SPI_result_code_string(ret));
	got = palloc(sizeof(pg_uuid_t) * Max(SPI_processed, 1));
	for (r = 0; r < SPI_processed; r++)
	{
		bool		isnull;

		memcpy(&got[r], DatumGetUUIDP(SPI_getbinval(SPI_tuptable->vals[r],
													SPI_tuptable->tupdesc, 1, &isnull)),
			   UUID_LEN);
	}
	qsort(got, SPI_processed, sizeof(pg_uuid_t), seen_id_cmp);
	for (i = 0; i < n; i++)
		recorded[i] = bsearch(&ids[i], got, SPI_processed, sizeof(pg_uuid_t), seen_id_cmp) != NULL;
}

/*
 * inbox_dedupe_rotate_if_due
 *		At most once a minute (four times per window when it is shorter),
 *		in a transaction of its own (call between
 *		batches): when the current slot has been current for
 *		outbox.inbox_dedupe_window, empty the other one and make it
 *		current.  A slot some other session holds a lock on (pg_dump reading
 *		it) is left for the next look, so the worker never waits on it.
 */
void
inbox_dedupe_rotate_if_due(void)
{
	TimestampTz now = GetCurrentTimestamp();
	int			ret;
	bool		isnull;
	int			slot;
	TimestampTz since;
	Oid			other_rel;

	if (!TimestampDifferenceExceeds(last_rotate_check, now, (int) ROTATE_CHECK_INTERVAL()))
		return;
	last_rotate_check = now;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	ret = SPI_execute("SELECT current_slot, since FROM outbox.inbox_seen_window FOR UPDATE",
					  false, 1);
	if (ret != SPI_OK_SELECT || SPI_processed != 1)
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("outbox.inbox_seen_window must have one row")));
	slot = DatumGetInt16(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
	since = DatumGetTimestampTz(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2, &isnull));
	other_rel = get_relname_relid(slot == 0 ? "inbox_seen_1" : "inbox_seen_0",
								  get_namespace_oid(OUTBOX_SCHEMA, false));
	if (TimestampDifferenceExceeds(since, now, outbox_inbox_dedupe_window * 1000) &&
		OidIsValid(other_rel) &&
		ConditionalLockRelationOid(other_rel, AccessExclusiveLock))
	{
		SPI_execute(slot == 0 ? "TRUNCATE outbox.inbox_seen_1" : "TRUNCATE outbox.inbox_seen_0",
					false, 0);
		ret = SPI_execute(slot == 0 ?
						  "UPDATE outbox.inbox_seen_window SET current_slot = 1, since = pg_catalog.now()" :
						  "UPDATE outbox.inbox_seen_window SET current_slot = 0, since = pg_catalog.now()",
						  false, 0);
		if (ret != SPI_OK_UPDATE)
			elog(ERROR, "outbox inbox: switching the seen slot failed: %s",
				 SPI_result_code_string(ret));
		ereport(DEBUG1,
				(errmsg("outbox inbox: event ids older than outbox.inbox_dedupe_window dropped, slot %d is current",
						1 - slot)));
	}
	SPI_finish();
	PopActiveSnapshot();
	CommitTransactionCommand();
}

/*
 * inbox_dedupe_forget_plans
 *		Drop the kept plans (the extension was re-created, say); prepared
 *		again at next use.
 */
void
inbox_dedupe_forget_plans(void)
{
	int			i;

	for (i = 0; i < 2; i++)
	{
		if (probe_plans[i])
			SPI_freeplan(probe_plans[i]);
		if (insert_plans[i])
			SPI_freeplan(insert_plans[i]);
		if (record_many_plans[i])
			SPI_freeplan(record_many_plans[i]);
		probe_plans[i] = insert_plans[i] = record_many_plans[i] = NULL;
	}
	if (seen_many_plan)
		SPI_freeplan(seen_many_plan);
	seen_many_plan = NULL;
	last_rotate_check = 0;
}
