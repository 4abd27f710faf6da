/*-------------------------------------------------------------------------
 *
 * ops.c
 *	  Operations on the outbox from SQL: requeue failed events, pause and
 *	  resume the relay, replay kept events, purge published ones.
 *
 * These run in the caller's transaction, like emit(), and wake the relay
 * when that transaction commits so that what they changed takes effect at
 * once.  They are SECURITY DEFINER with a fixed search_path (see the install
 * script); PUBLIC may not execute them.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "config/guc.h"
#include "shared/shmem.h"
#include "write/emit.h"

#include "catalog/pg_type.h"
#include "catalog/namespace.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/timestamp.h"

PG_FUNCTION_INFO_V1(outbox_retry_failed_all);
PG_FUNCTION_INFO_V1(outbox_retry_failed_one);
PG_FUNCTION_INFO_V1(outbox_pause);
PG_FUNCTION_INFO_V1(outbox_resume);
PG_FUNCTION_INFO_V1(outbox_replay_since);
PG_FUNCTION_INFO_V1(outbox_replay_range);
PG_FUNCTION_INFO_V1(outbox_purge);

/*
 * Clearing the backoff and the permanent-failure count gives the event a
 * fresh set of outbox.max_attempts attempts; attempts keeps its history.
 */
#define REQUEUE_SET \
	"UPDATE outbox.events" \
	"   SET failed_at = NULL, permanent_failures = 0, next_attempt_at = NULL" \
	" WHERE published_at IS NULL AND failed_at IS NOT NULL"

/*
 * Run one data-modifying statement and return the number of rows it
 * changed; wake the relay at commit if wake and anything changed.
 */
static uint64
run(const char *sql, int nargs, Oid *argtypes, Datum *values, bool wake)
{
	int			ret;
	uint64		n;

	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	ret = SPI_execute_with_args(sql, nargs, argtypes, values, NULL, false, 0);
	if (ret != SPI_OK_UPDATE && ret != SPI_OK_DELETE)
		elog(ERROR, "outbox: \"%s\" failed: %s", sql,
			 SPI_result_code_string(ret));
	n = SPI_processed;
	SPI_finish();

	if (n > 0 && wake)
		outbox_register_wakeup_at_commit(true);
	return n;
}

/*
 * WARNING when no relay acts on what the calling function changes: the
 * library is not preloaded, or the relay serves another database
 * (outbox.database).  The call still does its work in this database's
 * tables, but a silent success would suggest the relay was paused, resumed
 * or given events to send.  Unlike emit()'s warning, this comes with every
 * call: operations are rare and deliberate.
 */
static void
warn_if_not_relayed_here(FunctionCallInfo fcinfo)
{
	char	   *dbname = NULL;

	switch (outbox_relay_coverage(&dbname))
	{
		case OUTBOX_NOT_PRELOADED:
			ereport(WARNING,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("outbox.%s() has no effect on any relay now: the outbox library is not in shared_preload_libraries",
							get_func_name(fcinfo->flinfo->fn_oid)),
					 errdetail("What it changed is stored: a relay that starts later in this database (outbox.database) acts on it."),
					 errhint("Add outbox to shared_preload_libraries and restart the server.")));
			break;
		case OUTBOX_OTHER_DATABASE:
			if (outbox_databases[0] != '\0')
			{
				ereport(WARNING,
						(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
						 errmsg("outbox.%s() in database \"%s\" has no effect on any relay now",
								get_func_name(fcinfo->flinfo->fn_oid), dbname),
						 errdetail("The relays serve the databases of outbox.databases only: %s. What it changed is stored: a relay that serves this database later acts on it.",
								   outbox_databases)));
				break;
			}
			ereport(WARNING,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("outbox.%s() in database \"%s\" has no effect on any relay now",
							get_func_name(fcinfo->flinfo->fn_oid), dbname),
					 errdetail("The relay serves database \"%s\" only (outbox.database). What it changed is stored: a relay that serves this database later acts on it.",
							   outbox_database),
					 errhint("Call it in database \"%s\".", outbox_database)));
			break;
		case OUTBOX_UNSERVABLE_DATABASE:
			ereport(WARNING,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("outbox.%s() in database \"%s\" has no effect on any relay now",
							get_func_name(fcinfo->flinfo->fn_oid), dbname),
					 errdetail("It is a template or does not accept connections, so no relay can connect to it. What it changed is stored: a relay that serves this database later acts on it.")));
			break;
		case OUTBOX_RELAYED:
			break;
	}
}

static uint64
requeue(const char *sql, int nargs, Oid *argtypes, Datum *values)
{
	return run(sql, nargs, argtypes, values, true);
}

/*
 * outbox_retry_failed_all
 *		SQL: outbox.retry_failed() RETURNS bigint
 *
 * Requeues every event marked failed and returns how many.  They are
 * retried in id order, so each still goes before the later events of its
 * aggregate.
 */
Datum
outbox_retry_failed_all(PG_FUNCTION_ARGS)
{
	warn_if_not_relayed_here(fcinfo);
	PG_RETURN_INT64((int64) requeue(REQUEUE_SET, 0, NULL, NULL));
}

/*
 * outbox_retry_failed_one
 *		SQL: outbox.retry_failed(event_id uuid) RETURNS boolean
 *
 * Requeues the failed event with this event_id.  False if there is no
 * unpublished event with that id marked failed.
 */
Datum
outbox_retry_failed_one(PG_FUNCTION_ARGS)
{
	Oid			argtypes[1] = {UUIDOID};
	Datum		values[1] = {PG_GETARG_DATUM(0)};

	warn_if_not_relayed_here(fcinfo);

	PG_RETURN_BOOL(requeue(REQUEUE_SET " AND event_id OPERATOR(pg_catalog.=) $1", 1, argtypes,
						   values) > 0);
}

/*
 * outbox_pause
 *		SQL: outbox.pause() RETURNS void
 *
 * Sets outbox.relay.paused.  The relay finishes the batch in flight and
 * then claims nothing until outbox.resume(); the flag is in a table, so a
 * pause survives restarts.
 *
 * pause() and resume() update the row whatever its state, never "WHERE NOT
 * paused": the update waits for a concurrent pause() or resume() to commit
 * and then applies to its result (READ COMMITTED), so the call that commits
 * last wins.  A filter would be checked against the row as it was before
 * the other call, and the later call would silently do nothing.
 */
Datum
outbox_pause(PG_FUNCTION_ARGS)
{
	warn_if_not_relayed_here(fcinfo);
	run("UPDATE outbox.relay SET paused = true,"
		" paused_at = CASE WHEN paused THEN paused_at ELSE pg_catalog.clock_timestamp() END,"
		" paused_by = CASE WHEN paused THEN paused_by ELSE session_user END",
		0, NULL, NULL, false);
	/* wake the relay even if it was paused already: it shows the state */
	outbox_register_wakeup_at_commit(true);
	PG_RETURN_VOID();
}

/*
 * outbox_resume
 *		SQL: outbox.resume() RETURNS void
 */
Datum
outbox_resume(PG_FUNCTION_ARGS)
{
	warn_if_not_relayed_here(fcinfo);
	run("UPDATE outbox.relay SET paused = false, paused_at = NULL, paused_by = NULL",
		0, NULL, NULL, false);
	outbox_register_wakeup_at_commit(true);
	PG_RETURN_VOID();
}

/*
 * Marking kept events unpublished is all a replay takes: the relay sends
 * them again in id order with their original event ids (consumers that
 * de-duplicate by id will see them as duplicates, by design).
 */
#define REPLAY_SET \
	"UPDATE outbox.events SET published_at = NULL, next_attempt_at = NULL" \
	" WHERE published_at IS NOT NULL"

/*
 * From 1.4 on, a published event tracked by snapshot has no published_at:
 * outbox.published() tells, and the replayed event is tracked row by row
 * from then on (xid = NULL), so that the relay sends it again.
 */
#define REPLAY_SET_14 \
	"UPDATE outbox.events AS e" \
	"   SET published_at = NULL, next_attempt_at = NULL, xid = NULL" \
	" WHERE outbox.published(e)"

/*
 * Is the installed schema 1.4 or later (outbox.relay_progress exists)?  The
 * library may be newer than the schema until ALTER EXTENSION outbox UPDATE.
 */
static bool
schema_tracks_snapshots(void)
{
	Oid			nsp = get_namespace_oid(OUTBOX_SCHEMA, true);

	return OidIsValid(nsp) && OidIsValid(get_relname_relid("relay_progress", nsp));
}

/*
 * outbox_replay_since
 *		SQL: outbox.replay(since timestamptz) RETURNS bigint
 *
 * Requeues every kept (published, not yet deleted) event created at or
 * after since; returns how many.
 */
Datum
outbox_replay_since(PG_FUNCTION_ARGS)
{
	Oid			argtypes[1] = {TIMESTAMPTZOID};
	Datum		values[1] = {PG_GETARG_DATUM(0)};

	warn_if_not_relayed_here(fcinfo);

	PG_RETURN_INT64((int64) run(schema_tracks_snapshots() ?
								REPLAY_SET_14 " AND e.created_at >= $1" :
								REPLAY_SET " AND created_at >= $1", 1, argtypes,
								values, true));
}

/*
 * outbox_replay_range
 *		SQL: outbox.replay(from_id bigint, to_id bigint) RETURNS bigint
 *
 * Requeues the kept, published events with from_id <= id <= to_id.
 * 22023 if from_id > to_id.
 */
Datum
outbox_replay_range(PG_FUNCTION_ARGS)
{
	Oid			argtypes[2] = {INT8OID, INT8OID};
	Datum		values[2] = {PG_GETARG_DATUM(0), PG_GETARG_DATUM(1)};

	warn_if_not_relayed_here(fcinfo);

	if (PG_GETARG_INT64(0) > PG_GETARG_INT64(1))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("from_id (" INT64_FORMAT ") must not be greater than to_id (" INT64_FORMAT ")",
						PG_GETARG_INT64(0), PG_GETARG_INT64(1))));
	PG_RETURN_INT64((int64) run(schema_tracks_snapshots() ?
								REPLAY_SET_14 " AND e.id BETWEEN $1 AND $2" :
								REPLAY_SET " AND id BETWEEN $1 AND $2", 2,
								argtypes, values, true));
}

/*
 * Does now - span fall before the first timestamptz (4713 BC)?  Then
 * "clock_timestamp() - span" would fail with 22008 (timestamp out of range),
 * and no event can be that old.  Months and days are counted at their mean
 * length; the two years of margin cover what that estimate may miss (an
 * interval that close to the limit deletes nothing either way).  An
 * infinite interval (PostgreSQL 17) counts as very long.
 */
static bool
reaches_before_timestamps(const Interval *span)
{
	double		span_us;
	double		room_us;

	span_us = ((double) span->month * DAYS_PER_YEAR / MONTHS_PER_YEAR +
			   (double) span->day) * USECS_PER_DAY + (double) span->time;
	room_us = (double) (GetCurrentTimestamp() - MIN_TIMESTAMP);
	return span_us > room_us - 2 * DAYS_PER_YEAR * USECS_PER_DAY;
}

/*
 * outbox_purge
 *		SQL: outbox.purge(older_than interval) RETURNS bigint
 *
 * Deletes published events published more than older_than ago, at once
 * (the relay does the same by itself after outbox.retention).  Pending and
 * failed events are never deleted.  22023 for a negative interval; an
 * interval reaching back before timestamptz's range deletes nothing.
 */
Datum
outbox_purge(PG_FUNCTION_ARGS)
{
	Interval   *older_than = PG_GETARG_INTERVAL_P(0);
	Interval	zero = {0};
	Oid			argtypes[1] = {INTERVALOID};
	Datum		values[1] = {PG_GETARG_DATUM(0)};

	if (DatumGetBool(DirectFunctionCall2(interval_lt, IntervalPGetDatum(older_than),
										 IntervalPGetDatum(&zero))))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("older_than must not be negative")));
	if (reaches_before_timestamps(older_than))
		PG_RETURN_INT64(0);
	if (schema_tracks_snapshots())
		PG_RETURN_INT64((int64) run("DELETE FROM outbox.events AS e"
									" WHERE outbox.published(e)"
									"   AND COALESCE(e.published_at, e.created_at)"
									"       < pg_catalog.clock_timestamp() - $1",
									1, argtypes, values, false));
	PG_RETURN_INT64((int64) run("DELETE FROM outbox.events"
								" WHERE published_at IS NOT NULL"
								"   AND published_at < pg_catalog.clock_timestamp() - $1",
								1, argtypes, values, false));
}
