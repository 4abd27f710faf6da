/*-------------------------------------------------------------------------
 *
 * inbox_dead.c
 *	  Dead letters of the inbox (outbox.inbox_dead): events whose handler
 *	  failed, and the events of their key that wait behind them.
 *
 * With on_failed_event = hold (the default) a key whose event failed is
 * held: its later events are not applied but written here, held, in
 * arrival order, so that outbox.inbox_retry() can apply the failed event
 * and then the held ones in their order.  A key is held while a dead letter
 * of the subscription, topic and key exists.  The probe costs an index
 * lookup per event only while the subscription has dead letters at all
 * (checked once per batch).  Events without a key are never held: Kafka
 * gives them no order.
 *
 * Everything here runs in the apply transaction, with SPI connected, as
 * the worker.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "inbox/inbox.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "utils/builtins.h"

static SPIPlanPtr exist_plan = NULL;
static SPIPlanPtr held_plan = NULL;
static SPIPlanPtr insert_plan = NULL;

static SPIPlanPtr
keep(const char *sql, int nargs, Oid *types)
{
	SPIPlanPtr	plan = SPI_prepare(sql, nargs, types);

	if (plan == NULL || SPI_keepplan(plan) != 0)
		elog(ERROR, "outbox inbox: could not prepare \"%s\"", sql);
	return plan;
}

/*
 * inbox_dead_exist
 *		Has subscription any dead letter?
 */
bool
inbox_dead_exist(const char *subscription)
{
	Datum		values[1];
	int			ret;

	if (exist_plan == NULL)
	{
		Oid			types[1] = {TEXTOID};

		exist_plan = keep("SELECT 1 FROM outbox.inbox_dead WHERE subscription = $1 LIMIT 1",
						  1, types);
	}
	values[0] = CStringGetTextDatum(subscription);
	ret = SPI_execute_plan(exist_plan, values, NULL, true, 1);
	if (ret != SPI_OK_SELECT)
		elog(ERROR, "outbox inbox: reading the dead letters failed: %s",
			 SPI_result_code_string(ret));
	return SPI_processed > 0;
}

/*
 * inbox_key_held
 *		Does a dead letter hold ev's key (same subscription and topic)?
 *		Only asked when the subscription holds keys and has dead letters.
 */
bool
inbox_key_held(const char *subscription, const InboxEvent *ev)
{
	Datum		values[3];
	int			ret;

	if (ev->key == NULL)
		return false;
	if (held_plan == NULL)
	{
		Oid			types[3] = {TEXTOID, TEXTOID, TEXTOID};

		held_plan = keep("SELECT 1 FROM outbox.inbox_dead"
						 " WHERE subscription = $1 AND topic = $2 AND key = $3 LIMIT 1",
						 3, types);
	}
	values[0] = CStringGetTextDatum(subscription);
	values[1] = CStringGetTextDatum(ev->topic);
	values[2] = PointerGetDatum(ev->key);
	ret = SPI_execute_plan(held_plan, values, NULL, false, 1);
	if (ret != SPI_OK_SELECT)
		elog(ERROR, "outbox inbox: reading the dead letters failed: %s",
			 SPI_result_code_string(ret));
	return SPI_processed > 0;
}

/*
 * inbox_dead_insert
 *		Write ev as a dead letter of subscription: held (waits behind a
 *		failed event of its key; error and sqlstate NULL), or failed with
 *		the handler's error, its SQLSTATE (5 characters) and the attempts
 *		made so far.
 */
void
inbox_dead_insert(const char *subscription, const InboxEvent *ev, bool held,
				  const char *error, const char *sqlstate, int attempts)
{
	Datum		values[16];
	char		nulls[16];
	int			ret;

	if (insert_plan == NULL)
	{
		Oid			types[16] = {TEXTOID, TEXTOID, INT4OID, INT8OID, TEXTOID, UUIDOID,
			TEXTOID, TEXTOID, JSONBOID, JSONBOID, BYTEAOID, TIMESTAMPTZOID,
		BOOLOID, TEXTOID, TEXTOID, INT4OID};

		insert_plan = keep("INSERT INTO outbox.inbox_dead (subscription, topic, kafka_partition,"
						   " kafka_offset, key, event_id, event_type, aggregate_type, headers,"
						   " payload, payload_bytes, kafka_timestamp, held, error, sqlstate, attempts)"
						   " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)",
						   16, types);
	}
	inbox_event_values(ev, subscription, values, nulls);
	values[12] = BoolGetDatum(held);
	nulls[12] = ' ';
	values[13] = error ? CStringGetTextDatum(error) : (Datum) 0;
	nulls[13] = error ? ' ' : 'n';
	values[14] = sqlstate ? CStringGetTextDatum(sqlstate) : (Datum) 0;
	nulls[14] = sqlstate ? ' ' : 'n';
	values[15] = Int32GetDatum(attempts);
	nulls[15] = ' ';
	ret = SPI_execute_plan(insert_plan, values, nulls, false, 0);
	if (ret != SPI_OK_INSERT)
		elog(ERROR, "outbox inbox: writing a dead letter failed: %s",
			 SPI_result_code_string(ret));
}

/*
 * inbox_retry_requested
 *		Did outbox.inbox_retry() ask to apply dead letters of subscription
 *		again?
 */
bool
inbox_retry_requested(const char *subscription)
{
	Datum		values[1];
	int			ret;

	values[0] = CStringGetTextDatum(subscription);
	ret = SPI_execute_with_args("SELECT 1 FROM outbox.inbox_dead WHERE subscription = $1 AND retry LIMIT 1",
								1, (Oid[]) {TEXTOID}, values, NULL, true, 1);
	if (ret != SPI_OK_SELECT)
		elog(ERROR, "outbox inbox: reading the dead letters failed: %s",
			 SPI_result_code_string(ret));
	return SPI_processed > 0;
}

/*
 * inbox_dead_load_retry
 *		The dead letters a retry of subscription applies, in id order, into
 *		*events (palloc'd in the current context); returns how many.  Those
 *		marked retry, and with them the later dead letters of the same topic
 *		and key (held behind them, or arrived since the retry was asked).
 */
int
inbox_dead_load_retry(const char *subscription, InboxEvent **events)
{
	Datum		values[1];
	int			ret;
	uint64		i;

	values[0] = CStringGetTextDatum(subscription);
	ret = SPI_execute_with_args("SELECT d.id, d.subscription, d.topic, d.kafka_partition, d.kafka_offset,"
								" d.key, d.event_id, d.event_type, d.aggregate_type, d.headers,"
								" d.payload, d.payload_bytes, d.kafka_timestamp, d.attempts"
								"  FROM outbox.inbox_dead AS d"
								" WHERE d.subscription = $1"
								"   AND (d.retry OR (d.key IS NOT NULL AND EXISTS"
								"        (SELECT 1 FROM outbox.inbox_dead AS r"
								"          WHERE r.subscription = d.subscription AND r.topic = d.topic"
								"            AND r.key = d.key AND r.retry AND r.id < d.id)))"
								" ORDER BY d.id",
								1, (Oid[]) {TEXTOID}, values, NULL, false, 0);
	if (ret != SPI_OK_SELECT)
		elog(ERROR, "outbox inbox: reading the dead letters failed: %s",
			 SPI_result_code_string(ret));
	*events = palloc0(sizeof(InboxEvent) * Max(SPI_processed, 1));
	for (i = 0; i < SPI_processed; i++)
	{
		bool		isnull;

		inbox_event_from_row(&(*events)[i], SPI_tuptable->vals[i], SPI_tuptable->tupdesc);
		(*events)[i].attempts = DatumGetInt32(SPI_getbinval(SPI_tuptable->vals[i],
															SPI_tuptable->tupdesc, 14, &isnull));
	}
	return (int) SPI_processed;
}

/*
 * inbox_dead_resolve
 *		A retried dead letter is done: applied, or a duplicate of an event
 *		applied meanwhile.  Deletes it.
 */
void
inbox_dead_resolve(int64 dead_id)
{
	Datum		values[1];
	int			ret;

	values[0] = Int64GetDatum(dead_id);
	ret = SPI_execute_with_args("DELETE FROM outbox.inbox_dead WHERE id = $1",
								1, (Oid[]) {INT8OID}, values, NULL, false, 0);
	if (ret != SPI_OK_DELETE)
		elog(ERROR, "outbox inbox: deleting a dead letter failed: %s",
			 SPI_result_code_string(ret));
}

/*
 * inbox_dead_failed_again
 *		A retried dead letter stays: it failed again (error and sqlstate
 *		set, one more attempt) or waits behind one that did (error NULL:
 *		held).  Its retry mark is cleared.
 */
void
inbox_dead_failed_again(int64 dead_id, const char *error, const char *sqlstate,
						int attempts)
{
	Datum		values[4];
	char		nulls[4] = {' ', ' ', ' ', ' '};
	int			ret;

	values[0] = Int64GetDatum(dead_id);
	values[1] = error ? CStringGetTextDatum(error) : (Datum) 0;
	values[2] = sqlstate ? CStringGetTextDatum(sqlstate) : (Datum) 0;
	values[3] = Int32GetDatum(attempts);
	if (error == NULL)
		nulls[1] = nulls[2] = 'n';
	if (error == NULL)
		ret = SPI_execute_with_args("UPDATE outbox.inbox_dead SET retry = false WHERE id = $1",
									1, (Oid[]) {INT8OID}, values, nulls, false, 0);
	else
		ret = SPI_execute_with_args("UPDATE outbox.inbox_dead SET retry = false, held = false, error = $2,"
									" sqlstate = $3, attempts = $4,"
									" failed_at = pg_catalog.clock_timestamp() WHERE id = $1",
									4, (Oid[]) {INT8OID, TEXTOID, TEXTOID, INT4OID},
									values, nulls, false, 0);
	if (ret != SPI_OK_UPDATE)
		elog(ERROR, "outbox inbox: updating a dead letter failed: %s",
			 SPI_result_code_string(ret));
}

/*
 * inbox_dead_forget_plans
 *		Drop the kept plans; prepared again at next use.
 */
void
inbox_dead_forget_plans(void)
{
	if (exist_plan)
		SPI_freeplan(exist_plan);
	if (held_plan)
		SPI_freeplan(held_plan);
	if (insert_plan)
		SPI_freeplan(insert_plan);
	exist_plan = held_plan = insert_plan = NULL;
}
