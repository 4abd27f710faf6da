/*-------------------------------------------------------------------------
 *
 * status.c
 *	  outbox.worker_status(): the relay worker's shared-memory state as SQL.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"

#include "fmgr.h"
#include "funcapi.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"
#include "utils/tuplestore.h"

PG_FUNCTION_INFO_V1(outbox_worker_status);

/*
 * outbox_worker_status
 *		SQL: outbox.worker_status() RETURNS SETOF record (database, pid,
 *		state, published, failed, delivery_errors, last_publish_at,
 *		last_error, last_error_at, started_at).
 *
 * One row while a relay worker runs, none otherwise (and none when the
 * library is not preloaded).  Copies the struct under its spinlock and
 * builds the row afterwards, so the worker is never kept waiting.
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
	OutboxShared snapshot;
	Datum	   *values;
	bool	   *nulls;
	int			i;

	InitMaterializedSRF(fcinfo, 0);

	if (outbox_shared == NULL)
		return (Datum) 0;

	SpinLockAcquire(&outbox_shared->mutex);
	memcpy(&snapshot, outbox_shared, sizeof(OutboxShared));
	SpinLockRelease(&outbox_shared->mutex);

	if (snapshot.worker_pid == 0)
		return (Datum) 0;

	tupdesc = rsinfo->setDesc;
	values = palloc0(sizeof(Datum) * tupdesc->natts);
	nulls = palloc0(sizeof(bool) * tupdesc->natts);
	for (i = 0; i < tupdesc->natts; i++)
	{
		const char *name = NameStr(TupleDescAttr(tupdesc, i)->attname);

		if (strcmp(name, "database") == 0)
			values[i] = DirectFunctionCall1(namein,
											CStringGetDatum(snapshot.database_name));
		else if (strcmp(name, "pid") == 0)
			values[i] = Int32GetDatum(snapshot.worker_pid);
		else if (strcmp(name, "state") == 0)
			values[i] = CStringGetTextDatum(outbox_state_name(snapshot.state));
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
	return (Datum) 0;
}
