/*-------------------------------------------------------------------------
 *
 * status.c
 *	  The relay's state machine as seen from outside, and
 *	  outbox.worker_status().
 *
 * The relay worker (worker.c, and message.c while it waits for Kafka) moves
 * between the states of OutboxRelayState with outbox_enter_state(), which
 * logs each change that matters to a DBA once, not once per event or batch.
 * The state, the counters and the last error are copied into shared memory
 * (shmem.c), where outbox.worker_status() reads them.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "status.h"

#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"
#include "utils/tuplestore.h"

PG_FUNCTION_INFO_V1(outbox_worker_status);

/* the relay worker's state; the copy in shared memory is for others */
static OutboxRelayState current_state = OUTBOX_STATE_STARTING;

static void set_shared_state(OutboxRelayState state);
static const char *state_name(OutboxRelayState state);

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
					 errdetail("%s", error ? error : "all brokers are down"),
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
			if (old_state == OUTBOX_STATE_BROKER_DOWN)
				ereport(LOG,
						(errmsg("outbox relay reached Kafka again at \"%s\"",
								outbox_bootstrap_servers)));
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

/*
 * outbox_status_set_error
 *		Record the last error (truncated to OUTBOX_ERROR_LEN - 1 bytes) and
 *		its time.  The caller makes sure it holds no secret.
 */
void
outbox_status_set_error(const char *error)
{
	TimestampTz now = GetCurrentTimestamp();

	if (outbox_my_slot == NULL)
		return;
	SpinLockAcquire(&outbox_my_slot->mutex);
	strlcpy(outbox_my_slot->last_error, error, OUTBOX_ERROR_LEN);
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
	strlcpy(slot->last_error, error ? error : "", OUTBOX_ERROR_LEN);
	SpinLockRelease(&slot->mutex);
}

/*
 * outbox_worker_status
 *		SQL: outbox.worker_status() RETURNS SETOF record (database, pid,
 *		state, published, failed, delivery_errors, last_publish_at,
 *		last_error, last_error_at, started_at).
 *
 * One row per relay slot in use: with outbox.databases empty (1.x, one
 * relay) whatever database it serves; otherwise only the relays of the
 * current database.  No rows when the library is not in
 * shared_preload_libraries.  Copies each slot under its spinlock and builds
 * the row afterwards, so no relay is ever kept waiting.
 *
 * Columns are filled by name from the declared result, so the same C
 * function serves every version of the SQL definition (1.0 had no
 * delivery_errors): an upgraded library works before ALTER EXTENSION UPDATE.
 */
Datum
outbox_worker_status(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	TupleDesc	tupdesc;
	OutboxRelaySlot snapshot;
	int			n;
	Datum	   *values;
	bool	   *nulls;
	int			i;

	InitMaterializedSRF(fcinfo, 0);

	if (outbox_shared == NULL)
		return (Datum) 0;

	tupdesc = rsinfo->setDesc;
	values = palloc0(sizeof(Datum) * tupdesc->natts);
	nulls = palloc0(sizeof(bool) * tupdesc->natts);
	for (n = 0; n < outbox_shared->nslots; n++)
	{
		SpinLockAcquire(&outbox_shared->slots[n].mutex);
		memcpy(&snapshot, &outbox_shared->slots[n], sizeof(OutboxRelaySlot));
		SpinLockRelease(&outbox_shared->slots[n].mutex);

		if (snapshot.worker_pid == 0 ||
			(outbox_databases[0] != '\0' && snapshot.database_oid != MyDatabaseId))
			continue;
		memset(nulls, 0, sizeof(bool) * tupdesc->natts);
		for (i = 0; i < tupdesc->natts; i++)
		{
			const char *name = NameStr(TupleDescAttr(tupdesc, i)->attname);

			if (strcmp(name, "database") == 0)
				values[i] = DirectFunctionCall1(namein,
												CStringGetDatum(snapshot.database_name));
			else if (strcmp(name, "pid") == 0)
				values[i] = Int32GetDatum(snapshot.worker_pid);
			else if (strcmp(name, "state") == 0)
				values[i] = CStringGetTextDatum(state_name(snapshot.state));
			else if (strcmp(name, "published") == 0)
				values[i] = Int64GetDatum(snapshot.published);
			else if (strcmp(name, "failed") == 0)
				values[i] = Int64GetDatum(snapshot.failed);
			else if (strcmp(name, "delivery_errors") == 0)
				values[i] = Int64GetDatum(snapshot.delivery_errors);
			else if (strcmp(name, "last_publish_at") == 0)
			{
				values[i] = TimestampTzGetDatum(snapshot.last_publish_at);
				nulls[i] = snapshot.last_publish_at == 0;
			}
			else if (strcmp(name, "last_error") == 0)
			{
				values[i] = CStringGetTextDatum(snapshot.last_error);
				nulls[i] = snapshot.last_error[0] == '\0';
			}
			else if (strcmp(name, "last_error_at") == 0)
			{
				values[i] = TimestampTzGetDatum(snapshot.last_error_at);
				nulls[i] = snapshot.last_error_at == 0;
			}
			else if (strcmp(name, "started_at") == 0)
				values[i] = TimestampTzGetDatum(snapshot.started_at);
			else
				nulls[i] = true;	/* a column this library does not know */
		}

		tuplestore_putvalues(rsinfo->setResult, tupdesc, values, nulls);
	}
	return (Datum) 0;
}
