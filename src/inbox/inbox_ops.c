/*-------------------------------------------------------------------------
 *
 * inbox_ops.c
 *	  Operations on a subscription from SQL: pause, resume (and adopt a
 *	  restored copy), seek, retry dead letters.
 *
 * Like outbox.subscribe() (inbox_subscribe.c) they check the caller's
 * rights, write as the extension's owner, and take effect when the
 * caller's transaction commits, when the inbox worker is woken.  A seek
 * changes the offsets row the worker compares-and-sets: a batch the worker
 * is applying meanwhile rolls back, and the worker goes on from the new
 * offset.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "inbox/inbox.h"

#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"

PG_FUNCTION_INFO_V1(outbox_pause_subscription);
PG_FUNCTION_INFO_V1(outbox_resume_subscription);
PG_FUNCTION_INFO_V1(outbox_inbox_seek_offset);
PG_FUNCTION_INFO_V1(outbox_inbox_seek_time);
PG_FUNCTION_INFO_V1(outbox_inbox_seek_position);
PG_FUNCTION_INFO_V1(outbox_inbox_retry);

/*
 * Run sql with nargs arguments (the first the subscription's name) as the
 * extension's owner, after checking that the caller may manage the
 * subscription; returns the rows it changed.  Wakes the worker at commit.
 */
static uint64
manage(const char *name, const char *sql, int nargs, Oid *types, Datum *values,
	   char *nulls)
{
	Oid			caller = GetUserId();
	Oid			save_userid;
	int			save_sec;
	int			ret;
	uint64		n;

	inbox_switch_to_owner(&save_userid, &save_sec);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	(void) inbox_check_manage(name, caller, false, NULL);
	ret = SPI_execute_with_args(sql, nargs, types, values, nulls, false, 0);
	if (ret < 0)
		elog(ERROR, "outbox: \"%s\" failed: %s", sql, SPI_result_code_string(ret));
	n = SPI_processed;
	SPI_finish();
	inbox_switch_back(save_userid, save_sec);
	outbox_inbox_wake_at_commit();
	return n;
}

/*
 * outbox_pause_subscription
 *		SQL: outbox.pause_subscription(name text) RETURNS void.  Nothing is
 *		consumed after the batch in flight until outbox.resume_subscription().
 */
Datum
outbox_pause_subscription(PG_FUNCTION_ARGS)
{
	char	   *name = text_to_cstring(PG_GETARG_TEXT_PP(0));
	Datum		values[1] = {CStringGetTextDatum(name)};

	(void) manage(name, "UPDATE outbox.subscriptions SET paused = true WHERE name = $1",
				  1, (Oid[]) {TEXTOID}, values, NULL);
	PG_RETURN_VOID();
}

/*
 * outbox_resume_subscription
 *		SQL: outbox.resume_subscription(name text) RETURNS void.  Also adopts
 *		a restored copy: the subscription now belongs to this cluster and
 *		database, and applies from its offsets here.
 */
Datum
outbox_resume_subscription(PG_FUNCTION_ARGS)
{
	char	   *name = text_to_cstring(PG_GETARG_TEXT_PP(0));
	Datum		values[1] = {CStringGetTextDatum(name)};

	(void) manage(name,
				  "UPDATE outbox.subscriptions AS s SET paused = false,"
				  "       system_identifier = c.system_identifier, database_oid = d.oid,"
				  "       database_name = d.datname"
				  "  FROM pg_catalog.pg_control_system() AS c, pg_catalog.pg_database AS d"
				  " WHERE s.name = $1 AND d.datname = pg_catalog.current_database()",
				  1, (Oid[]) {TEXTOID}, values, NULL);
	PG_RETURN_VOID();
}

/*
 * Check the common arguments of both seeks: the subscription and topic
 * are not NULL, and the topic is one of the subscription's (22023).
 */
static void
check_seek(FunctionCallInfo fcinfo, char **name, char **topic)
{
	Datum		values[2];
	int			ret;
	Oid			save_userid;
	int			save_sec;
	bool		consumed;

	if (PG_ARGISNULL(0) || PG_ARGISNULL(1) || PG_ARGISNULL(3))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("only the partition of outbox.inbox_seek() may be NULL (every partition of the topic)")));
	*name = text_to_cstring(PG_GETARG_TEXT_PP(0));
	*topic = text_to_cstring(PG_GETARG_TEXT_PP(1));
	if (!PG_ARGISNULL(2) && PG_GETARG_INT32(2) < 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("a partition is 0 or more, not %d", PG_GETARG_INT32(2))));
	values[0] = CStringGetTextDatum(*name);
	values[1] = CStringGetTextDatum(*topic);
	inbox_switch_to_owner(&save_userid, &save_sec);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	ret = SPI_execute_with_args("SELECT 1 FROM outbox.subscriptions WHERE name = $1 AND $2 = ANY (topics)",
								2, (Oid[]) {TEXTOID, TEXTOID}, values, NULL, true, 1);
	if (ret != SPI_OK_SELECT)
		elog(ERROR, "outbox: reading the subscriptions failed: %s", SPI_result_code_string(ret));
	consumed = SPI_processed > 0;
	if (!consumed)
		(void) inbox_check_manage(*name, save_userid, false, NULL);
	SPI_finish();
	inbox_switch_back(save_userid, save_sec);
	if (!consumed)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("subscription \"%s\" does not consume topic \"%s\"", *name, *topic)));
}

/*
 * The partitions of topic that subscription name knows (has offsets rows
 * for), as a list for a message: "0, 1, 2", or NULL when it knows none.
 */
static char *
known_partitions(const char *name, const char *topic)
{
	Datum		values[2];
	Oid			save_userid;
	int			save_sec;
	int			ret;
	bool		isnull;
	Datum		list;
	char	   *result = NULL;
	MemoryContext caller = CurrentMemoryContext;

	values[0] = CStringGetTextDatum(name);
	values[1] = CStringGetTextDatum(topic);
	inbox_switch_to_owner(&save_userid, &save_sec);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	ret = SPI_execute_with_args("SELECT pg_catalog.string_agg(kafka_partition::text, ', ' ORDER BY kafka_partition)"
								"  FROM outbox.inbox_offsets WHERE subscription = $1 AND topic = $2",
								2, (Oid[]) {TEXTOID, TEXTOID}, values, NULL, true, 1);
	if (ret != SPI_OK_SELECT || SPI_processed != 1)
		elog(ERROR, "outbox: reading the offsets failed: %s", SPI_result_code_string(ret));
	list = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull);
	if (!isnull)
		result = MemoryContextStrdup(caller, TextDatumGetCString(list));
	SPI_finish();
	inbox_switch_back(save_userid, save_sec);
	return result;
}

/*
 * Move the offsets of (name, topic, partition or every partition when
 * NULL) to next_offset, with seek_time (NULL: none).  Returns the
 * partitions moved.  A partition given must be one the subscription knows
 * (the worker made its row when it saw it in Kafka): 22023 otherwise,
 * naming those it knows.
 */
static uint64
seek(FunctionCallInfo fcinfo, const char *name, const char *topic,
	 int64 next_offset, Datum seek_time, bool has_time)
{
	Datum		values[5];
	char		nulls[5] = {' ', ' ', ' ', ' ', ' '};
	uint64		n;
	char	   *known;

	values[0] = CStringGetTextDatum(name);
	values[1] = CStringGetTextDatum(topic);
	values[2] = PG_ARGISNULL(2) ? (Datum) 0 : Int32GetDatum(PG_GETARG_INT32(2));
	values[3] = Int64GetDatum(next_offset);
	values[4] = seek_time;
	if (PG_ARGISNULL(2))
		nulls[2] = 'n';
	if (!has_time)
		nulls[4] = 'n';
	n = manage(name,
			   "UPDATE outbox.inbox_offsets SET next_offset = CASE WHEN $5 IS NULL THEN $4 ELSE next_offset END,"
			   "       seek_time = $5, witness_offset = NULL, witness_hash = NULL"
			   " WHERE subscription = $1 AND topic = $2 AND ($3 IS NULL OR kafka_partition = $3)",
			   5, (Oid[]) {TEXTOID, TEXTOID, INT4OID, INT8OID, TIMESTAMPTZOID}, values, nulls);
	if (n > 0 || PG_ARGISNULL(2))
		return n;
	known = known_partitions(name, topic);
	if (known == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("subscription \"%s\" knows no partition %d of topic \"%s\"",
						name, PG_GETARG_INT32(2), topic),
				 errdetail("It knows no partition of the topic yet: the topic does not exist, or the inbox has not seen it yet."),
				 errhint("outbox.inbox_status lists the partitions once the inbox has seen them; before, start_from of outbox.subscribe() says where they begin.")));
	ereport(ERROR,
			(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
			 errmsg("subscription \"%s\" knows no partition %d of topic \"%s\"",
					name, PG_GETARG_INT32(2), topic),
			 errhint("The partitions it knows of the topic are %s (NULL seeks them all).", known)));
	return 0;					/* keep the compiler quiet */
}

/*
 * outbox_inbox_seek_offset
 *		SQL: outbox.inbox_seek(subscription text, topic text,
 *		kafka_partition integer, kafka_offset bigint) RETURNS bigint.
 */
Datum
outbox_inbox_seek_offset(PG_FUNCTION_ARGS)
{
	char	   *name;
	char	   *topic;

	check_seek(fcinfo, &name, &topic);
	if (PG_GETARG_INT64(3) < 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("a Kafka offset is 0 or more, not %lld", (long long) PG_GETARG_INT64(3)),
				 errhint("outbox.inbox_seek(..., 'earliest') seeks to the first offset, 'latest' to the end.")));
	PG_RETURN_INT64((int64) seek(fcinfo, name, topic, PG_GETARG_INT64(3), (Datum) 0, false));
}

/*
 * outbox_inbox_seek_time
 *		SQL: outbox.inbox_seek(subscription text, topic text,
 *		kafka_partition integer, kafka_timestamp timestamptz) RETURNS bigint.
 *		-infinity: the first offset, infinity: the end, any other time is
 *		looked up in Kafka by the worker.
 */
Datum
outbox_inbox_seek_time(PG_FUNCTION_ARGS)
{
	char	   *name;
	char	   *topic;
	TimestampTz when;

	check_seek(fcinfo, &name, &topic);
	when = PG_GETARG_TIMESTAMPTZ(3);
	if (TIMESTAMP_IS_NOBEGIN(when))
		PG_RETURN_INT64((int64) seek(fcinfo, name, topic, -2, (Datum) 0, false));
	if (TIMESTAMP_IS_NOEND(when))
		PG_RETURN_INT64((int64) seek(fcinfo, name, topic, -1, (Datum) 0, false));
	PG_RETURN_INT64((int64) seek(fcinfo, name, topic, 0, TimestampTzGetDatum(when), true));
}

/*
 * outbox_inbox_seek_position
 *		SQL: outbox.inbox_seek(subscription text, topic text,
 *		kafka_partition integer, start_from text) RETURNS bigint.  The
 *		positions of subscribe()'s start_from (inbox_parse_position):
 *		earliest or '-infinity', latest or 'infinity', an offset, a time.
 */
Datum
outbox_inbox_seek_position(PG_FUNCTION_ARGS)
{
	char	   *name;
	char	   *topic;
	InboxPosition pos;

	check_seek(fcinfo, &name, &topic);
	inbox_parse_position(text_to_cstring(PG_GETARG_TEXT_PP(3)), "start_from", &pos);
	switch (pos.kind)
	{
		case INBOX_POSITION_EARLIEST:
			PG_RETURN_INT64((int64) seek(fcinfo, name, topic, -2, (Datum) 0, false));
		case INBOX_POSITION_LATEST:
			PG_RETURN_INT64((int64) seek(fcinfo, name, topic, -1, (Datum) 0, false));
		case INBOX_POSITION_OFFSET:
			PG_RETURN_INT64((int64) seek(fcinfo, name, topic, pos.offset, (Datum) 0, false));
		case INBOX_POSITION_TIME:
			break;
	}
	PG_RETURN_INT64((int64) seek(fcinfo, name, topic, 0, TimestampTzGetDatum(pos.time), true));
}

/*
 * outbox_inbox_retry
 *		SQL: outbox.inbox_retry(subscription text, key text DEFAULT NULL)
 *		RETURNS bigint.  Marks the dead letters of the subscription (of one
 *		key) for the worker to apply again; returns how many.
 */
Datum
outbox_inbox_retry(PG_FUNCTION_ARGS)
{
	char	   *name;
	Datum		values[2];
	char		nulls[2] = {' ', ' '};

	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("the subscription of outbox.inbox_retry() must not be NULL")));
	name = text_to_cstring(PG_GETARG_TEXT_PP(0));
	values[0] = CStringGetTextDatum(name);
	values[1] = PG_ARGISNULL(1) ? (Datum) 0 : PG_GETARG_DATUM(1);
	if (PG_ARGISNULL(1))
		nulls[1] = 'n';
	PG_RETURN_INT64((int64) manage(name,
								   "UPDATE outbox.inbox_dead SET retry = true"
								   " WHERE subscription = $1 AND ($2::text IS NULL OR key = $2)",
								   2, (Oid[]) {TEXTOID, TEXTOID}, values, nulls));
}
