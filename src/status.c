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

#define WORKER_STATUS_COLS	9

/*
 * outbox_worker_status
 *		SQL: outbox.worker_status() RETURNS SETOF record (database, pid,
 *		state, published, failed, last_publish_at, last_error,
 *		last_error_at, started_at).
 *
 * One row while a relay worker runs, none otherwise (and none when the
 * library is not preloaded).  Copies the struct under its spinlock and
 * builds the row afterwards, so the worker is never kept waiting.
 */
Datum
outbox_worker_status(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	OutboxShared snapshot;
	Datum		values[WORKER_STATUS_COLS];
	bool		nulls[WORKER_STATUS_COLS];

	InitMaterializedSRF(fcinfo, 0);

	if (outbox_shared == NULL)
		return (Datum) 0;

	SpinLockAcquire(&outbox_shared->mutex);
	memcpy(&snapshot, outbox_shared, sizeof(OutboxShared));
	SpinLockRelease(&outbox_shared->mutex);

	if (snapshot.worker_pid == 0)
		return (Datum) 0;

	memset(nulls, 0, sizeof(nulls));
	values[0] = CStringGetDatum(snapshot.database_name);
	values[0] = DirectFunctionCall1(namein, values[0]);
	values[1] = Int32GetDatum(snapshot.worker_pid);
	values[2] = CStringGetTextDatum(outbox_state_name(snapshot.state));
	values[3] = Int64GetDatum(snapshot.published);
	values[4] = Int64GetDatum(snapshot.failed);
	values[5] = TimestampTzGetDatum(snapshot.last_publish_at);
	nulls[5] = snapshot.last_publish_at == 0;
	values[6] = CStringGetTextDatum(snapshot.last_error);
	nulls[6] = snapshot.last_error[0] == '\0';
	values[7] = TimestampTzGetDatum(snapshot.last_error_at);
	nulls[7] = snapshot.last_error_at == 0;
	values[8] = TimestampTzGetDatum(snapshot.started_at);

	tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	return (Datum) 0;
}
