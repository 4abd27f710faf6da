/*-------------------------------------------------------------------------
 *
 * inbox_take.c
 *	  outbox.inbox_take(): queue mode, events handed to application code
 *	  inside the application's own transaction.
 *
 * A subscription without a handler has the inbox worker insert each event
 * into outbox.inbox, in the transaction that advances its Kafka offsets.
 * inbox_take() deletes and returns a few of them in the caller's
 * transaction, so an application (Java, Go, Node, ...) that takes events
 * and writes their effects in one transaction applies each event exactly
 * once: a rollback gives them back, a commit removes them with the effects.
 *
 * Order: of each topic and key only the first pending event is handed out
 * (a later one waits until the earlier one's take committed), and rows
 * another transaction holds are skipped (FOR UPDATE SKIP LOCKED), so
 * several workers can take at once without waiting on each other or
 * reordering a key.  Events without a key have no order to keep.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "inbox/inbox.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/tuplestore.h"

PG_FUNCTION_INFO_V1(outbox_inbox_take);

#define TAKE_SQL \
	"WITH taken AS (" \
	"  DELETE FROM outbox.inbox AS i" \
	"   WHERE i.id IN (SELECT c.id FROM outbox.inbox AS c" \
	"                   WHERE c.subscription = $1" \
	"                     AND NOT EXISTS (SELECT 1 FROM outbox.inbox AS p" \
	"                                      WHERE p.subscription = c.subscription" \
	"                                        AND p.topic = c.topic AND p.key = c.key" \
	"                                        AND p.id < c.id)" \
	"                   ORDER BY c.id LIMIT $2" \
	"                   FOR UPDATE OF c SKIP LOCKED)" \
	"  RETURNING i.*)" \
	"SELECT * FROM taken ORDER BY id"

/*
 * outbox_inbox_take
 *		SQL: outbox.inbox_take(subscription text, max integer DEFAULT 100)
 *		RETURNS SETOF outbox.inbox (see the file header).  The caller needs
 *		the privileges of the subscription's owner (42501); 42704 if there
 *		is no such subscription, 22023 if max is below 1.
 */
Datum
outbox_inbox_take(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	Oid			caller = GetUserId();
	char	   *name;
	Datum		values[2];
	Oid			save_userid;
	int			save_sec;
	int			ret;
	uint64		i;
	bool		has_handler;

	if (PG_ARGISNULL(0) || PG_ARGISNULL(1))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("the arguments of outbox.inbox_take() must not be NULL")));
	if (PG_GETARG_INT32(1) < 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("max must be 1 or more, not %d", PG_GETARG_INT32(1))));
	name = text_to_cstring(PG_GETARG_TEXT_PP(0));
	InitMaterializedSRF(fcinfo, 0);

	inbox_switch_to_owner(&save_userid, &save_sec);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	(void) inbox_check_manage(name, caller, false, &has_handler);
	/* a handler's subscription queues nothing: 0 rows forever would look like an empty queue */
	if (has_handler)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("subscription \"%s\" has a handler: its events are applied, not queued", name),
				 errhint("outbox.inbox_take() is for subscriptions made without a handler (queue mode).")));
	values[0] = CStringGetTextDatum(name);
	values[1] = Int64GetDatum((int64) PG_GETARG_INT32(1));
	ret = SPI_execute_with_args(TAKE_SQL, 2, (Oid[]) {TEXTOID, INT8OID}, values, NULL,
								false, 0);
	if (ret != SPI_OK_SELECT)
		elog(ERROR, "outbox: taking events failed: %s", SPI_result_code_string(ret));
	if (SPI_tuptable->tupdesc->natts != rsinfo->setDesc->natts)
		ereport(ERROR,
				(errcode(ERRCODE_DATATYPE_MISMATCH),
				 errmsg("outbox.inbox has %d columns, the result of outbox.inbox_take() %d",
						SPI_tuptable->tupdesc->natts, rsinfo->setDesc->natts)));
	for (i = 0; i < SPI_processed; i++)
	{
		Datum	   *row = palloc(sizeof(Datum) * rsinfo->setDesc->natts);
		bool	   *nulls = palloc(sizeof(bool) * rsinfo->setDesc->natts);

		heap_deform_tuple(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, row, nulls);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, row, nulls);
	}
	SPI_finish();
	inbox_switch_back(save_userid, save_sec);
	return (Datum) 0;
}
