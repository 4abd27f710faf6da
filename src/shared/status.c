/*-------------------------------------------------------------------------
 *
 * status.c
 *	  The relay's state machine as seen from outside:
 *	  outbox.worker_status() and outbox.cluster_status().
 *
 * The relay worker (worker.c, and message.c while it waits for Kafka) moves
 * between the states of OutboxRelayState with outbox_enter_state(), which
 * logs each change that matters to a DBA once, not once per event or batch.
 * The state, the counters and the last error are copied into shared memory
 * (shmem.c), where outbox.worker_status() and outbox.cluster_status() read
 * them, together with what the launcher publishes there.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "shared/status.h"
#include "config/guc.h"
#include "shared/partition.h"
#include "shared/shmem.h"
#include "shared/inbox_shmem.h"

#include "fmgr.h"
#include "funcapi.h"
#include "lib/stringinfo.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "catalog/pg_type.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"
#include "utils/tuplestore.h"

PG_FUNCTION_INFO_V1(outbox_worker_status);
PG_FUNCTION_INFO_V1(outbox_cluster_status);
PG_FUNCTION_INFO_V1(outbox_worker_buckets);

/* one row of worker_status() or cluster_status(), before it is built */
typedef struct StatusRow
{
	const char *kind;			/* "relay" or "launcher" */
	const char *state;
	OutboxRelaySlot slot;		/* a copy: database, pid, counters, error */
} StatusRow;

/* the relay worker's state; the copy in shared memory is for others */
static OutboxRelayState current_state = OUTBOX_STATE_STARTING;

static void set_shared_state(OutboxRelayState state);
static void clear_error(void);
static const char *state_name(OutboxRelayState state);
static bool relay_row(int n, StatusRow *row);
static int	unserved_rows(StatusRow **rows);
static void put_row(ReturnSetInfo *rsinfo, const StatusRow *row);
static void put_relay_rows(ReturnSetInfo *rsinfo, bool all);

/*
 * How many bytes of error fit in a last_error buffer (OUTBOX_ERROR_LEN with
 * its terminator), cut at a character boundary of the database encoding: a
 * byte count alone may cut a multibyte character in two (an error text can
 * quote a topic or an aggregate), and the status views would then return
 * invalid text.  Computed before the spinlock is taken.
 */
static int
error_length(const char *error)
{
	return pg_mbcliplen(error, strlen(error), OUTBOX_ERROR_LEN - 1);
}

/*
 * outbox_enter_state
 *		Change the relay's state (shown by outbox.status) and log the
 *		changes that matter to a DBA, each once: the broker going away and
 *		coming back, the relay waiting for its extension, no configuration.
 *		error, if not NULL, becomes the status' last error.
 */
void
outbox_enter_state(OutboxRelayState new_state, const char *error)
{
	OutboxRelayState old_state = current_state;

	if (new_state == old_state)
		return;
	current_state = new_state;
	set_shared_state(new_state);
	if (error != NULL)
		outbox_status_set_error(error);

	switch (new_state)
	{
		case OUTBOX_STATE_BROKER_DOWN:
			ereport(WARNING,
					(errmsg("outbox relay cannot deliver events to Kafka at \"%s\"",
							outbox_bootstrap_servers),
					 errdetail("%s", error && error[0] ? error :
							   "librdkafka gave no reason: every broker is down, or no delivery report came in time"),
					 errhint("Events stay in outbox.events and are retried; this is logged again only once Kafka is reachable.")));
			break;
		case OUTBOX_STATE_NOT_CONFIGURED:
			ereport(LOG,
					(errmsg("outbox relay is idle: outbox.bootstrap_servers is empty"),
					 errhint("Set outbox.bootstrap_servers in postgresql.conf and reload the configuration.")));
			break;
		case OUTBOX_STATE_WAITING_FOR_EXTENSION:
			ereport(LOG,
					(errmsg("outbox relay is waiting for CREATE EXTENSION outbox in database \"%s\"",
							outbox_relay_database)));
			break;
		case OUTBOX_STATE_PAUSED:
			ereport(LOG,
					(errmsg("outbox relay is paused"),
					 errdetail("Events wait in outbox.events until SELECT outbox.resume().")));
			break;
		default:
			/* only what can tell: a batch went out, or there was none */
			if (old_state == OUTBOX_STATE_BROKER_DOWN &&
				(new_state == OUTBOX_STATE_IDLE || new_state == OUTBOX_STATE_PUBLISHING))
			{
				/* the broker's error is history now: the log keeps it */
				clear_error();
				ereport(LOG,
						(errmsg("outbox relay reached Kafka again at \"%s\"",
								outbox_bootstrap_servers)));
			}
			else if (old_state == OUTBOX_STATE_PAUSED)
				ereport(LOG, (errmsg("outbox relay resumed")));
			else if (old_state == OUTBOX_STATE_WAITING_FOR_EXTENSION)
				ereport(LOG,
						(errmsg("outbox relay found the extension in database \"%s\"",
								outbox_relay_database)));
			else if (old_state == OUTBOX_STATE_CONFIG_ERROR)
				ereport(LOG,
						(errmsg("outbox relay accepted the Kafka settings")));
			break;
	}
}

/*
 * outbox_relay_state
 *		The state the relay worker last entered (OUTBOX_STATE_STARTING
 *		before its first outbox_enter_state()).  Only meaningful in the
 *		relay worker.
 */
OutboxRelayState
outbox_relay_state(void)
{
	return current_state;
}

/*
 * Record the worker's state for outbox.status.
 */
static void
set_shared_state(OutboxRelayState state)
{
	if (outbox_my_slot == NULL)
		return;
	SpinLockAcquire(&outbox_my_slot->mutex);
	outbox_my_slot->state = state;
	SpinLockRelease(&outbox_my_slot->mutex);
}

/* forget the last error (outbox.status shows NULL) */
static void
clear_error(void)
{
	if (outbox_my_slot == NULL)
		return;
	SpinLockAcquire(&outbox_my_slot->mutex);
	outbox_my_slot->last_error[0] = '\0';
	outbox_my_slot->last_error_at = 0;
	SpinLockRelease(&outbox_my_slot->mutex);
}

/*
 * outbox_status_set_error
 *		Record the last error (truncated to OUTBOX_ERROR_LEN - 1 bytes) and
 *		its time.  The caller makes sure it holds no secret.
 */
void
outbox_status_set_error(const char *error)
{
	TimestampTz now = GetCurrentTimestamp();
	int			len = error_length(error);

	if (outbox_my_slot == NULL)
		return;
	SpinLockAcquire(&outbox_my_slot->mutex);
	memcpy(outbox_my_slot->last_error, error, len);
	outbox_my_slot->last_error[len] = '\0';
	outbox_my_slot->last_error_at = now;
	SpinLockRelease(&outbox_my_slot->mutex);
}

/*
 * outbox_status_count
 *		Add a batch's acknowledged events, events marked failed and failed
 *		delivery attempts to the counters.
 */
void
outbox_status_count(int64 published, int64 failed, int64 delivery_errors)
{
	TimestampTz now = GetCurrentTimestamp();

	if (outbox_my_slot == NULL)
		return;
	SpinLockAcquire(&outbox_my_slot->mutex);
	outbox_my_slot->published += published;
	outbox_my_slot->failed += failed;
	outbox_my_slot->delivery_errors += delivery_errors;
	if (published > 0)
		outbox_my_slot->last_publish_at = now;
	SpinLockRelease(&outbox_my_slot->mutex);
}

/*
 * The name outbox.status shows for a state.
 */
static const char *
state_name(OutboxRelayState state)
{
	switch (state)
	{
		case OUTBOX_STATE_STARTING:
			return "starting";
		case OUTBOX_STATE_WAITING_FOR_DATABASE:
			return "waiting_for_database";
		case OUTBOX_STATE_WAITING_FOR_EXTENSION:
			return "waiting_for_extension";
		case OUTBOX_STATE_NOT_CONFIGURED:
			return "not_configured";
		case OUTBOX_STATE_CONFIG_ERROR:
			return "config_error";
		case OUTBOX_STATE_IDLE:
			return "idle";
		case OUTBOX_STATE_PUBLISHING:
			return "publishing";
		case OUTBOX_STATE_BROKER_DOWN:
			return "broker_down";
		case OUTBOX_STATE_PAUSED:
			return "paused";
		case OUTBOX_STATE_ERROR:
			return "error";
	}
	return "unknown";
}

/*
 * outbox_status_slot
 *		Record the state and error of a slot the launcher holds for a relay
 *		that cannot connect yet (state waiting_for_database): the launcher's
 *		pid shows in outbox.status until the relay runs.  pid 0 frees it.
 */
void
outbox_status_slot(OutboxRelaySlot *slot, pid_t pid, OutboxRelayState state,
				   const char *error)
{
	TimestampTz now = GetCurrentTimestamp();
	int			len = error_length(error ? error : "");

	SpinLockAcquire(&slot->mutex);
	if (slot->worker_pid != pid)
	{
		slot->started_at = now;
		slot->published = slot->failed = slot->delivery_errors = 0;
		slot->last_publish_at = 0;
	}
	slot->worker_pid = pid;
	slot->worker_latch = NULL;
	slot->state = state;
	/* the launcher calls this every pass: the time is when the error began */
	if (error == NULL)
		slot->last_error_at = 0;
	else if (strncmp(slot->last_error, error, OUTBOX_ERROR_LEN - 1) != 0 ||
			 slot->last_error_at == 0)
		slot->last_error_at = now;
	memcpy(slot->last_error, error ? error : "", len);
	slot->last_error[len] = '\0';
	SpinLockRelease(&slot->mutex);
}

/*
 * outbox_status_refused
 *		Show in the launcher's slot that the relay of database dbname
 *		exited before it connected: the database refused it (a FATAL in the
 *		server log: no CONNECT privilege, the role's connection limit, ...),
 *		which the launcher cannot foresee from the shared catalogs.  The
 *		launcher keeps the slot until its next try, delay_ms from now:
 *		without it the database would have no row in outbox.status and
 *		outbox.cluster_status(), and its events would wait unseen.
 */
void
outbox_status_refused(OutboxRelaySlot *slot, const char *dbname, int delay_ms)
{
	outbox_status_slot(slot, MyProcPid, OUTBOX_STATE_WAITING_FOR_DATABASE,
					   psprintf("the relay could not connect to database \"%s\"%s%s%s (see the server log); next try in %d s",
								dbname,
								outbox_role[0] != '\0' ? " as role \"" : "",
								outbox_role, outbox_role[0] != '\0' ? "\"" : "",
								Max(delay_ms / 1000, 1)));
}

/*
 * Copy relay slot n into row; false if no relay (or launcher waiting for
 * the relay's database) holds it.  Copies under the slot's spinlock and
 * builds the row afterwards, so no relay is ever kept waiting.
 */
static bool
relay_row(int n, StatusRow *row)
{
	SpinLockAcquire(&outbox_shared->slots[n].mutex);
	memcpy(&row->slot, &outbox_shared->slots[n], sizeof(OutboxRelaySlot));
	SpinLockRelease(&outbox_shared->slots[n].mutex);
	row->kind = "relay";
	row->state = state_name(row->slot.state);
	/* an inbox worker's slot shows in cluster_status() as kind inbox */
	return row->slot.worker_pid != 0 && !row->slot.inbox;
}

/*
 * Set *result to a palloc'd array of rows for the covered databases the
 * launcher could not start a relay for, with no pid: state waiting_for_slot
 * (last_error saying which budget is used up) or waiting_for_database
 * (last_error saying why it cannot be connected to), last_error_at since
 * when.  Returns how many.
 */
static int
unserved_rows(StatusRow **result)
{
	OutboxUnserved *list = palloc(sizeof(OutboxUnserved) * OUTBOX_MAX_UNSERVED);
	StatusRow  *rows;
	int			n;
	int			i;

	SpinLockAcquire(&outbox_shared->mutex);
	n = outbox_shared->nunserved;
	memcpy(list, outbox_shared->unserved, sizeof(OutboxUnserved) * n);
	SpinLockRelease(&outbox_shared->mutex);

	*result = rows = palloc(sizeof(StatusRow) * Max(n, 1));

	for (i = 0; i < n; i++)
	{
		memset(&rows[i], 0, sizeof(StatusRow));
		rows[i].kind = "relay";
		rows[i].state = list[i].waiting_for_database ?
			"waiting_for_database" : "waiting_for_slot";
		rows[i].slot.database_oid = list[i].dboid;
		strlcpy(rows[i].slot.database_name, list[i].name, NAMEDATALEN);
		if (list[i].waiting_for_database)
			strlcpy(rows[i].slot.last_error, list[i].obstacle, OUTBOX_ERROR_LEN);
		else if (list[i].no_bgworker)
			strlcpy(rows[i].slot.last_error,
					"no free background worker slot: max_worker_processes is used up",
					OUTBOX_ERROR_LEN);
		else
			snprintf(rows[i].slot.last_error, OUTBOX_ERROR_LEN,
					 "outbox.max_workers (%d) relays run already", outbox_max_workers);
		rows[i].slot.last_error_at = list[i].since;
	}
	pfree(list);
	return n;
}

/*
 * outbox_status_unserved
 *		Launcher only: publish the count covered databases of list that
 *		have no relay (outbox.cluster_status() and their outbox.status show
 *		them), and log those left out for want of a slot, once per change
 *		of that set, and once when all are served again.  Databases waiting
 *		to be connected to are logged by the launcher itself.
 */
void
outbox_status_unserved(const OutboxUnserved *list, int count)
{
	static char *logged = NULL; /* the names last logged */
	StringInfoData names;
	int			nnames = 0;
	bool		no_bgworker = false;
	int			i;

	outbox_set_unserved(list, count);

	initStringInfo(&names);
	for (i = 0; i < count; i++)
	{
		if (list[i].waiting_for_database)
			continue;
		appendStringInfo(&names, "%s\"%s\"", nnames++ > 0 ? ", " : "", list[i].name);
		no_bgworker |= list[i].no_bgworker;
	}
	if (logged != NULL && strcmp(logged, names.data) == 0)
		return;
	if (nnames > 0)
		ereport(WARNING,
				(errcode(ERRCODE_CONFIGURATION_LIMIT_EXCEEDED),
				 errmsg("outbox: %d database(s) have no relay: %s", nnames, names.data),
				 no_bgworker ?
				 errdetail("No background worker slot was free (max_worker_processes = %d).",
						   max_worker_processes) :
				 errdetail("outbox.max_workers (%d) relays run already.", outbox_max_workers),
				 errhint("Raise outbox.max_workers or max_worker_processes (both need a restart), or cover fewer databases with outbox.databases. Their events wait in outbox.events.")));
	else if (logged != NULL && logged[0] != '\0')
		ereport(LOG,
				(errmsg("outbox: every covered database has a relay again")));
	if (logged != NULL)
		pfree(logged);
	logged = MemoryContextStrdup(TopMemoryContext, names.data);
}

/*
 * The key buckets of relay worker of nworkers (partition.c), as an
 * int4range: '[0,256)' for a database's only relay.
 */
static Datum
bucket_range(int worker, int nworkers)
{
	Oid			input;
	Oid			ioparam;

	getTypeInputInfo(INT4RANGEOID, &input, &ioparam);
	return OidInputFunctionCall(input,
								psprintf("[%d,%d)", outbox_bucket_first(worker, nworkers),
										 outbox_bucket_first(worker + 1, nworkers)),
								ioparam, -1);
}

/*
 * Build row and add it to the result.  Columns are filled by name from the
 * declared result, so the same C function serves every version of the SQL
 * definition (1.0 had no delivery_errors, cluster_status() has kind): an
 * upgraded library works before ALTER EXTENSION UPDATE.  A zero pid or
 * time, or an empty name or error, is NULL.
 */
static void
put_row(ReturnSetInfo *rsinfo, const StatusRow *row)
{
	TupleDesc	tupdesc = rsinfo->setDesc;
	const OutboxRelaySlot *s = &row->slot;
	Datum	   *values = palloc0(sizeof(Datum) * tupdesc->natts);
	bool	   *nulls = palloc0(sizeof(bool) * tupdesc->natts);
	/* the relay's own row; one the launcher holds has no buckets */
	bool		relay_runs = s->worker_latch != NULL && s->nworkers > 0;
	int			i;

	for (i = 0; i < tupdesc->natts; i++)
	{
		const char *name = NameStr(TupleDescAttr(tupdesc, i)->attname);
		TimestampTz time = -1;

		if (strcmp(name, "kind") == 0)
			values[i] = CStringGetTextDatum(row->kind);
		else if (strcmp(name, "database") == 0)
		{
			values[i] = DirectFunctionCall1(namein, CStringGetDatum(s->database_name));
			nulls[i] = s->database_name[0] == '\0';
		}
		else if (strcmp(name, "pid") == 0)
		{
			values[i] = Int32GetDatum(s->worker_pid);
			nulls[i] = s->worker_pid == 0;
		}
		else if (strcmp(name, "state") == 0)
			values[i] = CStringGetTextDatum(row->state);
		else if (strcmp(name, "published") == 0)
			values[i] = Int64GetDatum(s->published);
		else if (strcmp(name, "failed") == 0)
			values[i] = Int64GetDatum(s->failed);
		else if (strcmp(name, "delivery_errors") == 0)
			values[i] = Int64GetDatum(s->delivery_errors);
		else if (strcmp(name, "last_error") == 0)
		{
			values[i] = CStringGetTextDatum(s->last_error);
			nulls[i] = s->last_error[0] == '\0';
		}
		else if (strcmp(name, "worker") == 0)
		{
			values[i] = Int32GetDatum(s->worker + 1);
			nulls[i] = !relay_runs;
		}
		else if (strcmp(name, "workers") == 0)
		{
			values[i] = Int32GetDatum(s->nworkers);
			nulls[i] = !relay_runs;
		}
		else if (strcmp(name, "buckets") == 0)
		{
			nulls[i] = !relay_runs;
			if (relay_runs)
				values[i] = bucket_range(s->worker, s->nworkers);
		}
		else if (strcmp(name, "last_publish_at") == 0)
			time = s->last_publish_at;
		else if (strcmp(name, "last_error_at") == 0)
			time = s->last_error_at;
		else if (strcmp(name, "started_at") == 0)
			time = s->started_at;
		else
			nulls[i] = true;	/* a column this library does not know */
		if (time != -1)
		{
			values[i] = TimestampTzGetDatum(time);
			nulls[i] = time == 0;
		}
	}
	tuplestore_putvalues(rsinfo->setResult, tupdesc, values, nulls);
	pfree(values);
	pfree(nulls);
}

/*
 * Add the rows of the relays, then of the databases waiting for a slot:
 * all of them, or (all false) those of the current database only.
 */
static void
put_relay_rows(ReturnSetInfo *rsinfo, bool all)
{
	StatusRow	row;
	StatusRow  *unserved;
	int			n;
	int			i;

	for (i = 0; i < outbox_shared->nslots; i++)
		if (relay_row(i, &row) && (all || row.slot.database_oid == MyDatabaseId))
			put_row(rsinfo, &row);
	n = unserved_rows(&unserved);
	for (i = 0; i < n; i++)
		if (all || unserved[i].slot.database_oid == MyDatabaseId)
			put_row(rsinfo, &unserved[i]);
	pfree(unserved);
}

/*
 * outbox_worker_status
 *		SQL: outbox.worker_status() RETURNS SETOF record (database, pid,
 *		state, published, failed, delivery_errors, last_publish_at,
 *		last_error, last_error_at, started_at).
 *
 * One row per relay slot in use: with outbox.databases empty (1.x, one
 * relay) whatever database it serves; otherwise only the relays of the
 * current database.  A covered database the launcher has no slot for gets
 * a row with state waiting_for_slot and no pid.  No rows when the library
 * is not in shared_preload_libraries.
 */
Datum
outbox_worker_status(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;

	InitMaterializedSRF(fcinfo, 0);
	if (outbox_shared != NULL)
		put_relay_rows(rsinfo, outbox_databases[0] == '\0');
	return (Datum) 0;
}

/*
 * outbox_worker_buckets
 *		SQL: outbox.worker_buckets() RETURNS SETOF record (pid, worker,
 *		workers, buckets).
 *
 * The key buckets of every running relay of the server (partition.c): the
 * columns are filled by name like worker_status()'s.  outbox.status joins
 * it by pid, and so do the postgres_exporter queries with cluster_status().
 * Readable by pg_monitor, never by PUBLIC.
 */
Datum
outbox_worker_buckets(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;

	InitMaterializedSRF(fcinfo, 0);
	if (outbox_shared != NULL)
		put_relay_rows(rsinfo, true);
	return (Datum) 0;
}

/*
 * outbox_cluster_status
 *		SQL: outbox.cluster_status() RETURNS SETOF record (kind, database,
 *		pid, state, published, failed, delivery_errors, last_publish_at,
 *		last_error, last_error_at, started_at).
 *
 * The whole server, from any database: first the launcher (kind
 * launcher, state running, or not_running with no pid while the
 * postmaster restarts it), then one row per relay of every database (the
 * rows of worker_status()), then the covered databases waiting for a slot
 * (waiting_for_slot).  Counters are since each relay started.  No rows
 * when the library is not in shared_preload_libraries.  Readable by
 * pg_monitor (the SQL grants say so), never by PUBLIC.
 */
Datum
outbox_cluster_status(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	StatusRow	row;

	InitMaterializedSRF(fcinfo, 0);
	if (outbox_shared == NULL)
		return (Datum) 0;

	memset(&row, 0, sizeof(row));
	row.kind = "launcher";
	SpinLockAcquire(&outbox_shared->mutex);
	row.slot.worker_pid = outbox_shared->launcher_pid;
	row.slot.started_at = outbox_shared->launcher_pid != 0 ?
		outbox_shared->launcher_started_at : 0;
	SpinLockRelease(&outbox_shared->mutex);
	row.state = row.slot.worker_pid != 0 ? "running" : "not_running";
	put_row(rsinfo, &row);
	put_relay_rows(rsinfo, true);
	outbox_inbox_cluster_rows(rsinfo);
	return (Datum) 0;
}
