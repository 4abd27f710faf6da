/*-------------------------------------------------------------------------
 *
 * ops.c
 *	  Operations on the outbox from SQL: requeueing failed events.
 *
 * These run in the caller's transaction, like emit(), and wake the relay
 * when that transaction commits so the requeued events go out at once.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "fmgr.h"

PG_FUNCTION_INFO_V1(outbox_retry_failed_all);
PG_FUNCTION_INFO_V1(outbox_retry_failed_one);

/*
 * Clearing the backoff and the permanent-failure count gives the event a
 * fresh set of outbox.max_attempts attempts; attempts keeps its history.
 */
#define REQUEUE_SET \
	"UPDATE outbox.events" \
	"   SET failed_at = NULL, permanent_failures = 0, next_attempt_at = NULL" \
	" WHERE published_at IS NULL AND failed_at IS NOT NULL"

static uint64
requeue(const char *sql, int nargs, Oid *argtypes, Datum *values)
{
	int			ret;
	uint64		n;

	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	ret = SPI_execute_with_args(sql, nargs, argtypes, values, NULL, false, 0);
	if (ret != SPI_OK_UPDATE)
		elog(ERROR, "could not requeue failed events: %s",
			 SPI_result_code_string(ret));
	n = SPI_processed;
	SPI_finish();

	if (n > 0)
		outbox_register_wakeup_at_commit();
	return n;
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

	PG_RETURN_BOOL(requeue(REQUEUE_SET " AND event_id OPERATOR(pg_catalog.=) $1", 1, argtypes,
						   values) > 0);
}
