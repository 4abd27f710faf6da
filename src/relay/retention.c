/*-------------------------------------------------------------------------
 *
 * retention.c
 *	  Delete published events once outbox.retention has passed, in chunks,
 *	  in a transaction of its own (outbox_relay_cleanup_if_due, called by
 *	  the worker between batches, at most once a second).
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "relay/retention.h"
#include "config/guc.h"
#include "relay/mark.h"
#include "relay/relay_xact.h"
#include "relay/snapshot.h"
#include "relay/vacuum.h"
#include "shared/partition.h"
#include "shared/status.h"

#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_namespace.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "utils/timestamp.h"

/* rows deleted per retention statement, and statements per cleanup call */
#define CLEANUP_CHUNK		10000
#define CLEANUP_MAX_CHUNKS	10

/* how often expired published rows are deleted, and retried after a failure */
#define CLEANUP_INTERVAL_MS		1000
#define CLEANUP_RETRY_MS		10000

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

/* saved plans, prepared on first use in this worker */
static SPIPlanPtr cleanup_plan = NULL;
static SPIPlanPtr cleanup_v2_plan = NULL;
static SPIPlanPtr oldest_row_plan = NULL;
static SPIPlanPtr cleanup_rows_plan = NULL;
static SPIPlanPtr cleanup_rows_bounded_plan = NULL;

/* the last retention cleanup failed (logged once until it works again) */
static bool cleanup_failing = false;

/*
 * In snapshot mode the retention of row-tracked events stops at the highest
 * id this process marked published (outbox_highest_published_id), which is
 * 0 after a start: row-tracked events published by an earlier relay process
 * (before a restart, or in row mode before a switch) would be kept for
 * ever.  So the highest id of those is read once per process (-1: not yet),
 * and forgotten (0) once none is left at or below it.
 */
static int64 earlier_published_id = -1;

/*
 * published_at of the oldest (lowest id) row-tracked published event as the
 * last probe found it not yet due, 0 if unknown.  Until it is due no probe
 * runs: each one walks the primary key from the lowest id, past every
 * snapshot-tracked event kept (in a test, 20,000 index tuples a second).
 */
static TimestampTz oldest_row_published_at = 0;

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
		int			ret = SPI_execute_plan(outbox_prepare_plan(cache, sql, nargs, types),
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
 * With outbox.relay_mode = snapshot: is the oldest (lowest id) row-tracked
 * published event below $3 due?  Only then does the retention read a chunk
 * of them; otherwise each second it would read CLEANUP_CHUNK young rows in
 * vain, which in snapshot mode is most of what the relay reads while a
 * minute of row-tracked events is kept (after a switch from row mode).  A
 * late-published event with an old id can delay the others' deletion until
 * it is due itself: retention is a minimum age.  One found not due is
 * remembered (oldest_row_published_at), and not looked for again before it
 * is due.
 */
static bool
oldest_row_tracked_due(Datum *args, bool *none)
{
	Oid			types[1] = {INT8OID};
	TimestampTz cutoff = DatumGetTimestampTz(args[0]);
	bool		isnull;
	Datum		d;

	*none = false;
	if (oldest_row_published_at != 0 && oldest_row_published_at >= cutoff)
		return false;
	if (SPI_execute_plan(outbox_prepare_plan(&oldest_row_plan,
											 "SELECT published_at FROM outbox.events"
											 " WHERE published_at IS NOT NULL AND xid IS NULL"
											 "   AND id <= $1 ORDER BY id LIMIT 1",
											 1, types),
						 &args[2], NULL, true, 1) != SPI_OK_SELECT)
		elog(ERROR, "could not read the oldest published event");
	oldest_row_published_at = 0;
	*none = (SPI_processed == 0);
	if (*none)
		return false;
	d = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
	if (isnull)
		return false;
	if (DatumGetTimestampTz(d) < cutoff)
		return true;
	oldest_row_published_at = DatumGetTimestampTz(d);
	return false;
}

/*
 * The highest id of a row-tracked event already published (0 if none),
 * for earlier_published_id.  A walk of the primary key down to the first
 * such event: the whole table when there is none, once per process.
 */
static int64
read_earlier_published_id(void)
{
	bool		isnull;
	Datum		d;

	if (SPI_execute("SELECT max(id) FROM outbox.events"
					" WHERE published_at IS NOT NULL AND xid IS NULL",
					true, 1) != SPI_OK_SELECT || SPI_processed != 1)
		elog(ERROR, "could not read the highest published event");
	d = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
	return isnull ? 0 : DatumGetInt64(d);
}

/*
 * May the relay's role look into schema outbox?  Without USAGE on it the
 * relay cannot publish either, and its batches say so (state error); the
 * retention then stays out of the way instead of warning that publishing
 * goes on without it.  No schema: outbox_lock_events_table() finds no table.
 */
static bool
relay_may_use_schema(void)
{
	Oid			nsp = get_namespace_oid(OUTBOX_SCHEMA, true);

	return !OidIsValid(nsp) ||
		outbox_namespace_aclcheck(nsp, GetUserId(), ACL_USAGE) == ACLCHECK_OK;
}

/*
 * Delete events published more than outbox.retention seconds ago.  Runs
 * in its own transaction, in chunks of CLEANUP_CHUNK rows, looking only
 * at the oldest rows of the table (published rows are the oldest), so its
 * cost does not grow with the table.  With retention 0 acknowledged rows
 * are deleted at once by the relay, and this deletes any published while
 * retention was still positive (the new value can arrive with SIGHUP after
 * a batch was marked).  Returns the number of rows deleted; 0 when retention
 * is off (-1) or the table is missing.  SPI errors are raised as ERROR.
 */
static int64
cleanup_published(void)
{
	int64		deleted = 0;
	Oid			relid;
	MemoryContext callercxt;

	if (outbox_retention < 0)
		return 0;

	callercxt = outbox_relay_xact_begin("outbox relay: deleting published events");
	relid = relay_may_use_schema() ? outbox_lock_events_table() : InvalidOid;
	if (OidIsValid(relid))
	{
		Oid			types[3] = {TIMESTAMPTZOID, INT4OID, INT8OID};
		Datum		args[3];
		bool		v14 = outbox_snapshot_schema(relid);
		int64		highest_published_id = outbox_highest_published_id();
		bool		none = false;

		args[0] = TimestampTzGetDatum(TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
																  -(int64) outbox_retention * 1000));
		args[1] = Int32GetDatum(CLEANUP_CHUNK);
		args[2] = Int64GetDatum(highest_published_id);

		if (!v14)
			deleted += cleanup_chunks(&cleanup_plan, cleanup_sql, 3, types, args);
		else
		{
			if (outbox_snapshot_events_exist() &&
				outbox_snapshot_oldest_created_before(DatumGetTimestampTz(args[0])))
			{
				/* a restored progress row must not decide what is deleted */
				outbox_snapshot_adopt();
				deleted += cleanup_chunks(&cleanup_v2_plan, cleanup_v2_sql, 2,
										  types, args);
			}
			if (outbox_rows_for_new_events())
				deleted += cleanup_chunks(&cleanup_rows_plan, cleanup_rows_sql, 3,
										  types, args);
			else
			{
				if (earlier_published_id < 0)
					earlier_published_id = read_earlier_published_id();
				highest_published_id = Max(highest_published_id, earlier_published_id);
				args[2] = Int64GetDatum(highest_published_id);
				if (highest_published_id > 0 && oldest_row_tracked_due(args, &none))
					deleted += cleanup_chunks(&cleanup_rows_bounded_plan,
											  cleanup_rows_bounded_sql, 3, types, args);
				else if (highest_published_id > 0 && none)
					earlier_published_id = 0;	/* all deleted */
			}
		}
	}
	outbox_relay_xact_end(callercxt, true);
	return deleted;
}

/*
 * Delete the published events retention no longer keeps.  Its failure (the
 * relay's role may lack DELETE, say) must not stop publishing, which does
 * not need it: it is logged once as a WARNING, shown as the status' last
 * error, and retried every CLEANUP_RETRY_MS until it works again.
 */
static void
delete_expired_events(void)
{
	MemoryContext cxt = CurrentMemoryContext;

	PG_TRY();
	{
		outbox_vacuum_count_deleted(cleanup_published());
		if (cleanup_failing)
			ereport(LOG,
					(errmsg("outbox relay deletes published events again")));
		cleanup_failing = false;
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		MemoryContextSwitchTo(cxt);
		edata = CopyErrorData();
		FlushErrorState();
		AbortCurrentTransaction();
		MemoryContextSwitchTo(cxt);
		pgstat_report_activity(STATE_IDLE, NULL);

		if (!cleanup_failing)
			ereport(WARNING,
					(errcode(edata->sqlerrcode),
					 errmsg("outbox relay cannot delete published events: %s", edata->message),
					 errdetail("Publishing goes on; published events older than outbox.retention stay in outbox.events until this is fixed. Retried every %d s.",
							   CLEANUP_RETRY_MS / 1000),
					 errhint("Grant the relay's role DELETE on outbox.events, or set outbox.retention = -1 to keep published events.")));
		outbox_status_set_error(psprintf("cannot delete published events: %s", edata->message));
		cleanup_failing = true;
		FreeErrorData(edata);
	}
	PG_END_TRY();
}

/*
 * outbox_relay_cleanup_if_due
 *		Delete the published events retention no longer keeps, if
 *		CLEANUP_INTERVAL_MS passed since the last cleanup (CLEANUP_RETRY_MS
 *		after a failed one).  Called by the worker at every pass of its loop,
 *		whatever the state of Kafka.
 *
 * Raises no ERROR: a failure is logged and shown in outbox.status
 * (delete_expired_events), and publishing goes on.
 */
void
outbox_relay_cleanup_if_due(void)
{
	static TimestampTz last_cleanup = 0;
	TimestampTz now = GetCurrentTimestamp();

	/* worker 0 of a database's relays cleans up for all of them */
	if (!outbox_relay_serves_all())
		return;

	if (!TimestampDifferenceExceeds(last_cleanup, now,
									cleanup_failing ? CLEANUP_RETRY_MS : CLEANUP_INTERVAL_MS))
		return;
	last_cleanup = now;
	delete_expired_events();
	outbox_vacuum_if_due();
}
