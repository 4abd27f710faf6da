/*-------------------------------------------------------------------------
 *
 * inbox_subscribe.c
 *	  outbox.subscribe() and outbox.unsubscribe(), and the access rules the
 *	  whole SQL API of the inbox shares.
 *
 * These functions are not SECURITY DEFINER: the role that calls
 * subscribe() (current_user, after any SET ROLE) becomes the subscription's
 * owner, and its handler runs as that role.  They check what the caller may
 * do here, then write the extension's tables as the extension's owner
 * (inbox_switch_to_owner), as pg_net does: the caller needs no right on the
 * tables.  Managing a subscription (unsubscribe, pause, resume, seek, retry,
 * take) needs the privileges of its owner role (membership), as ALTER and
 * DROP of an object would.  EXECUTE on every function is revoked from
 * PUBLIC; a DBA grants it.
 *
 * Changes take effect when the caller's transaction commits: the inbox
 * worker of the database is woken then (outbox_inbox_wake_at_commit), or
 * the launcher starts one.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "inbox/inbox.h"
#include "config/topic.h"

#include "access/htup_details.h"
#include "catalog/pg_extension.h"
#include "catalog/pg_proc.h"
#include "catalog/pg_type.h"
#include "commands/extension.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/regproc.h"
#include "utils/syscache.h"

PG_FUNCTION_INFO_V1(outbox_subscribe);
PG_FUNCTION_INFO_V1(outbox_unsubscribe);

static void check_name(const char *name);
static Datum check_topics(ArrayType *topics);
static char *check_start_from(const char *start_from);
static void position_context(void *arg);
static void check_handler(Oid handler);
static void former_ids_notice(const char *name);

/*
 * inbox_switch_to_owner
 *		Become the extension's owner to write its tables (see the file
 *		header); inbox_switch_back() undoes it.  An error in between is
 *		undone by the transaction's abort.
 */
void
inbox_switch_to_owner(Oid *save_userid, int *save_sec)
{
	Oid			ext = get_extension_oid(OUTBOX_EXTENSION_NAME, false);
	HeapTuple	tuple;
	Oid			owner;

	tuple = SearchSysCacheCopy1(EXTENSIONOID, ObjectIdGetDatum(ext));
	if (!HeapTupleIsValid(tuple))
		elog(ERROR, "cache lookup failed for extension %u", ext);
	owner = ((Form_pg_extension) GETSTRUCT(tuple))->extowner;
	heap_freetuple(tuple);
	GetUserIdAndSecContext(save_userid, save_sec);
	SetUserIdAndSecContext(owner, *save_sec | SECURITY_LOCAL_USERID_CHANGE);
}

void
inbox_switch_back(Oid save_userid, int save_sec)
{
	SetUserIdAndSecContext(save_userid, save_sec);
}

/*
 * inbox_check_manage
 *		ERROR unless subscription name exists (42704) and caller has the
 *		privileges of its owner (42501); returns the owner, and whether the
 *		subscription has a handler into *has_handler unless it is NULL.  The row stays
 *		locked to the end of the transaction: FOR UPDATE when drop, else
 *		FOR KEY SHARE.  Call with SPI connected, as the extension's owner,
 *		passing the caller's role.
 */
Oid
inbox_check_manage(const char *name, Oid caller, bool drop, bool *has_handler)
{
	Datum		values[1];
	int			ret;
	bool		isnull;
	Oid			owner;

	/*
	 * A handler that unsubscribed, paused or moved its own subscription
	 * would roll back its own batch, again and again: refuse it, so that the
	 * event becomes a dead letter like any handler error.
	 */
	if (inbox_applying != NULL && strcmp(inbox_applying, name) == 0)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_IN_USE),
				 errmsg("subscription \"%s\" cannot be managed from its own handler", name),
				 errdetail("The inbox is applying a batch of it in this transaction."),
				 errhint("Manage it from another session.")));

	/*
	 * FOR KEY SHARE keeps the subscription from being dropped meanwhile
	 * without keeping the worker or another session waiting; a drop locks
	 * it for itself.
	 */
	values[0] = CStringGetTextDatum(name);
	ret = SPI_execute_with_args(drop ?
								"SELECT owner::pg_catalog.oid, handler IS NOT NULL FROM outbox.subscriptions WHERE name = $1 FOR UPDATE" :
								"SELECT owner::pg_catalog.oid, handler IS NOT NULL FROM outbox.subscriptions WHERE name = $1 FOR KEY SHARE",
								1, (Oid[]) {TEXTOID}, values, NULL, false, 1);
	if (ret != SPI_OK_SELECT)
		elog(ERROR, "outbox: reading the subscriptions failed: %s", SPI_result_code_string(ret));
	if (SPI_processed != 1)
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("subscription \"%s\" does not exist", name),
				 errhint("SELECT name FROM outbox.subscriptions lists them.")));
	owner = DatumGetObjectId(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
	if (has_handler != NULL)
		*has_handler = DatumGetBool(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2, &isnull));
	if (!has_privs_of_role(caller, owner))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("must be a member of role \"%s\" to manage subscription \"%s\"",
						GetUserNameFromId(owner, true) ? GetUserNameFromId(owner, true) : "?",
						name)));
	return owner;
}

/*
 * A subscription name: 1 to 63 bytes, no control characters and not only
 * spaces (a newline in a name broke every listing of outbox.inbox_status).
 */
static void
check_name(const char *name)
{
	size_t		len = strlen(name);
	bool		blank = true;

	if (len == 0 || len > INBOX_NAME_MAX)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("a subscription name has 1 to %d bytes", INBOX_NAME_MAX),
				 errdetail("\"%s\" has %zu.", name, len)));
	for (const char *c = name; *c; c++)
	{
		if ((unsigned char) *c < 0x20 || *c == 0x7f)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("a subscription name must not contain control characters")));
		if (*c != ' ')
			blank = false;
	}
	if (blank)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("a subscription name must not be only spaces")));
}

/* what a position was given for, in the context line of a bad timestamp */
static void
position_context(void *arg)
{
	errcontext("%s must be earliest, latest, an offset or a timestamp", (const char *) arg);
}

/*
 * inbox_parse_position
 *		A position as subscribe()'s start_from and inbox_seek() take it, into
 *		*pos: earliest or '-infinity', latest or 'infinity' (in any case), an
 *		offset (digits; 22023 when negative), or a timestamp (22007 when it
 *		is none; an infinite one is earliest or latest).  what names the
 *		argument in errors.
 */
void
inbox_parse_position(const char *text, const char *what, InboxPosition *pos)
{
	const char *digits = text;
	ErrorContextCallback callback;

	memset(pos, 0, sizeof(*pos));
	if (pg_strcasecmp(text, "earliest") == 0 || pg_strcasecmp(text, "-infinity") == 0)
	{
		pos->kind = INBOX_POSITION_EARLIEST;
		return;
	}
	if (pg_strcasecmp(text, "latest") == 0 || pg_strcasecmp(text, "infinity") == 0 ||
		pg_strcasecmp(text, "+infinity") == 0)
	{
		pos->kind = INBOX_POSITION_LATEST;
		return;
	}
	if (*digits == '-' || *digits == '+')
		digits++;
	if (*digits != '\0' && strspn(digits, "0123456789") == strlen(digits))
	{
		char	   *end;

		errno = 0;
		pos->offset = strtoll(text, &end, 10);
		if (errno != 0 || *end != '\0' || pos->offset < 0)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("a Kafka offset is 0 or more, not %s", text),
					 errhint("%s may also be earliest, latest or a timestamp.", what)));
		pos->kind = INBOX_POSITION_OFFSET;
		return;
	}
	callback.callback = position_context;
	callback.arg = unconstify(char *, what);
	callback.previous = error_context_stack;
	error_context_stack = &callback;
	pos->time = DatumGetTimestampTz(DirectFunctionCall3(timestamptz_in,
														CStringGetDatum(text),
														ObjectIdGetDatum(InvalidOid),
														Int32GetDatum(-1)));
	error_context_stack = callback.previous;
	pos->kind = TIMESTAMP_IS_NOBEGIN(pos->time) ? INBOX_POSITION_EARLIEST :
		TIMESTAMP_IS_NOEND(pos->time) ? INBOX_POSITION_LATEST : INBOX_POSITION_TIME;
}

/*
 * start_from: a position (inbox_parse_position), returned as it is to be
 * stored: earliest, latest, the offset's digits, or the time as given (the
 * INSERT writes it in UTC, ISO 8601).
 */
static char *
check_start_from(const char *start_from)
{
	InboxPosition pos;

	inbox_parse_position(start_from, "start_from", &pos);
	switch (pos.kind)
	{
		case INBOX_POSITION_EARLIEST:
			return pstrdup("earliest");
		case INBOX_POSITION_LATEST:
			return pstrdup("latest");
		case INBOX_POSITION_OFFSET:
			return psprintf(INT64_FORMAT, pos.offset);
		case INBOX_POSITION_TIME:
			break;
	}
	return pstrdup(start_from);	/* the INSERT writes it in UTC */
}

/*
 * The topics: a one-dimensional array of legal, distinct topic names, none
 * of Kafka's internal ones.  Returns the array as a Datum.
 */
static Datum
check_topics(ArrayType *topics)
{
	Datum	   *elems;
	bool	   *nulls;
	char	  **names;
	int			n;
	int			i;
	int			j;

	if (ARR_NDIM(topics) > 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("topics must be a one-dimensional array")));
	/* the count first: a user's try with 100,000 names ran the host out of memory */
	if (ArrayGetNItems(ARR_NDIM(topics), ARR_DIMS(topics)) > INBOX_MAX_TOPICS)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("a subscription consumes at most %d topics", INBOX_MAX_TOPICS),
				 errhint("Split the topics over several subscriptions.")));
	deconstruct_array(topics, TEXTOID, -1, false, TYPALIGN_INT, &elems, &nulls, &n);
	if (n == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("a subscription needs at least one topic")));
	names = palloc(sizeof(char *) * n);
	for (i = 0; i < n; i++)
	{
		char	   *topic;

		if (nulls[i])
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("topics must not contain NULL")));
		topic = names[i] = TextDatumGetCString(elems[i]);
		if (!outbox_topic_is_legal(topic, strlen(topic)))
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("\"%s\" is not a legal Kafka topic name", topic),
					 errdetail("A topic name has 1 to %d ASCII letters, digits, '.', '_' and '-', and is not \".\" or \"..\"; topics are exact names, not patterns.",
							   OUTBOX_TOPIC_MAX_LEN)));
		if (outbox_topic_is_internal(topic))
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("\"%s\" is one of Kafka's internal topics", topic)));
		for (j = 0; j < i; j++)
			if (strcmp(topic, names[j]) == 0)
				ereport(ERROR,
						(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
						 errmsg("topic \"%s\" is named twice", topic)));
	}
	return PointerGetDatum(topics);
}

/*
 * The handler: a plain function (not a procedure, not returning a set) of
 * exactly one argument, outbox.inbox_event (per event) or
 * outbox.inbox_event[] (per batch) (42P13), which the caller may execute
 * (42501).
 */
static void
check_handler(Oid handler)
{
	HeapTuple	tuple = SearchSysCache1(PROCOID, ObjectIdGetDatum(handler));
	Form_pg_proc proc;
	bool		fits;

	if (!HeapTupleIsValid(tuple))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_FUNCTION),
				 errmsg("function with OID %u does not exist", handler)));
	proc = (Form_pg_proc) GETSTRUCT(tuple);
	fits = proc->prokind == PROKIND_FUNCTION && !proc->proretset &&
		proc->pronargs == 1 &&
		(proc->proargtypes.values[0] == inbox_event_type_oid() ||
		 proc->proargtypes.values[0] == get_array_type(inbox_event_type_oid()));
	ReleaseSysCache(tuple);
	if (!fits)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_FUNCTION_DEFINITION),
				 errmsg("%s cannot be an inbox handler", format_procedure(handler)),
				 errdetail("A handler is a function of one argument of type outbox.inbox_event (called per event) or outbox.inbox_event[] (called per batch) that returns no set."),
				 errhint("CREATE FUNCTION h(e outbox.inbox_event) RETURNS void ..., or h(events outbox.inbox_event[]).")));
	if (outbox_proc_aclcheck(handler, GetUserId(), ACL_EXECUTE) != ACLCHECK_OK)
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("permission denied for function %s", format_procedure(handler)),
				 errdetail("The handler runs as the role that subscribes, which needs EXECUTE on it.")));
}

/*
 * A subscription of this name was dropped, and the ids it applied are
 * still within the dedupe window (unsubscribe() keeps them): say that the
 * new one skips them.  Call with SPI connected, as the extension's owner.
 */
static void
former_ids_notice(const char *name)
{
	Datum		values[1] = {CStringGetTextDatum(name)};
	int			ret;

	ret = SPI_execute_with_args("SELECT 1 FROM outbox.inbox_seen WHERE subscription = $1 LIMIT 1",
								1, (Oid[]) {TEXTOID}, values, NULL, true, 1);
	if (ret != SPI_OK_SELECT)
		elog(ERROR, "outbox: reading the seen ids failed: %s", SPI_result_code_string(ret));
	if (SPI_processed > 0)
		ereport(NOTICE,
				(errmsg("subscription \"%s\" skips the events whose ids a former subscription of that name applied",
						name),
				 errdetail("outbox.unsubscribe() keeps the ids seen within outbox.inbox_dedupe_window; events without an id are applied again from start_from."),
				 errhint("Subscribe with another name, or with dedupe => false, to apply them again.")));
}

/*
 * outbox_subscribe
 *		SQL: outbox.subscribe(name text, topics text[], handler regprocedure
 *		DEFAULT NULL, on_failed_event text DEFAULT 'hold', dedupe boolean
 *		DEFAULT true, start_from text DEFAULT 'earliest') RETURNS void.
 *
 * Records the subscription, owned by the current user, for the inbox worker
 * to start at commit.  Errors: 22023 (and 22004, 22007) for a bad name,
 * topics, option or start_from; 42P13 for a handler of the wrong shape;
 * 42501 without EXECUTE on the handler or for a superuser while
 * outbox.inbox_superuser_subscriptions is off; 42710 if the name is taken.
 */
Datum
outbox_subscribe(PG_FUNCTION_ARGS)
{
	Oid			caller = GetUserId();
	char	   *name;
	char	   *on_failed;
	char	   *start_from;
	Datum		values[7];
	char		nulls[7] = {' ', ' ', ' ', ' ', ' ', ' ', ' '};
	Oid			save_userid;
	int			save_sec;
	int			ret;

	if (PG_ARGISNULL(0) || PG_ARGISNULL(1) || PG_ARGISNULL(3) || PG_ARGISNULL(4) || PG_ARGISNULL(5))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("only the handler of outbox.subscribe() may be NULL")));
	name = text_to_cstring(PG_GETARG_TEXT_PP(0));
	check_name(name);
	values[0] = CStringGetTextDatum(name);
	values[1] = check_topics(PG_GETARG_ARRAYTYPE_P(1));
	if (PG_ARGISNULL(2))
		nulls[2] = 'n';
	else
	{
		check_handler(PG_GETARG_OID(2));
		values[2] = CStringGetTextDatum(format_procedure_qualified(PG_GETARG_OID(2)));
	}
	on_failed = text_to_cstring(PG_GETARG_TEXT_PP(3));
	if (strcmp(on_failed, "hold") != 0 && strcmp(on_failed, "skip") != 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("on_failed_event must be hold or skip, not \"%s\"", on_failed)));
	values[3] = CStringGetTextDatum(on_failed);
	values[4] = PG_GETARG_DATUM(4);
	start_from = check_start_from(text_to_cstring(PG_GETARG_TEXT_PP(5)));
	values[5] = CStringGetTextDatum(start_from);
	values[6] = ObjectIdGetDatum(caller);
	if (superuser_arg(caller) && !outbox_inbox_superuser_subscriptions)
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("a superuser may not subscribe: its handler would run as a superuser"),
				 errhint("Subscribe as a role that is no superuser (SET ROLE), or set outbox.inbox_superuser_subscriptions = on.")));

	inbox_switch_to_owner(&save_userid, &save_sec);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	ret = SPI_execute_with_args("INSERT INTO outbox.subscriptions (name, owner, topics, handler,"
								" on_failed_event, dedupe, start_from, system_identifier, database_oid,"
								" database_name)"
								" SELECT $1, $7::pg_catalog.regrole, $2, $3, $4, $5,"
								"        CASE WHEN $6 IN ('earliest', 'latest') OR $6 ~ '^[0-9]+$' THEN $6"
								"             ELSE pg_catalog.to_char($6::timestamptz AT TIME ZONE 'UTC',"
								"                                     'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') END,"
								"        c.system_identifier, d.oid, d.datname"
								"   FROM pg_catalog.pg_control_system() AS c, pg_catalog.pg_database AS d"
								"  WHERE d.datname = pg_catalog.current_database()"
								" ON CONFLICT (name) DO NOTHING",
								7, (Oid[]) {TEXTOID, TEXTARRAYOID, TEXTOID, TEXTOID, BOOLOID, TEXTOID, OIDOID},
								values, nulls, false, 0);
	if (ret != SPI_OK_INSERT)
		elog(ERROR, "outbox: recording the subscription failed: %s", SPI_result_code_string(ret));
	if (SPI_processed != 1)
		ereport(ERROR,
				(errcode(ERRCODE_DUPLICATE_OBJECT),
				 errmsg("subscription \"%s\" already exists", name),
				 errhint("Choose another name, or outbox.unsubscribe('%s') first.", name)));
	if (DatumGetBool(values[4]))
		former_ids_notice(name);
	SPI_finish();
	inbox_switch_back(save_userid, save_sec);
	outbox_inbox_wake_at_commit();
	PG_RETURN_VOID();
}

/*
 * outbox_unsubscribe
 *		SQL: outbox.unsubscribe(name text) RETURNS void.
 *
 * Drops the subscription with its offsets, queued events and dead
 * letters; a WARNING says how many queued events and dead letters went
 * with it.  Its seen ids stay in outbox.inbox_seen until the dedupe
 * window's turns drop them: a subscription made again with the same name
 * (its offsets start anew, from its start_from) skips the events they
 * name, instead of applying them a second time.  The caller needs the owner's privileges (42501); 42704 if
 * there is no such subscription.
 */
Datum
outbox_unsubscribe(PG_FUNCTION_ARGS)
{
	Oid			caller = GetUserId();
	char	   *name = text_to_cstring(PG_GETARG_TEXT_PP(0));
	Datum		values[1];
	/*
	 * The subscription's row first: the worker holds it FOR KEY SHARE while
	 * it writes anything of the subscription, so once this DELETE has it,
	 * what the worker wrote is committed and seen by the DELETEs after it.
	 * The seen ids stay (see above).
	 */
	static const char *const deletes[] = {
		"DELETE FROM outbox.subscriptions WHERE name = $1",
		"DELETE FROM outbox.inbox WHERE subscription = $1",
		"DELETE FROM outbox.inbox_dead WHERE subscription = $1",
		"DELETE FROM outbox.inbox_offsets WHERE subscription = $1",
		"DELETE FROM outbox.inbox_keys WHERE subscription = $1",
	};
	uint64		counts[lengthof(deletes)];
	Oid			save_userid;
	int			save_sec;
	int			i;

	inbox_switch_to_owner(&save_userid, &save_sec);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	(void) inbox_check_manage(name, caller, true, NULL);
	values[0] = CStringGetTextDatum(name);
	for (i = 0; i < (int) lengthof(deletes); i++)
	{
		int			ret = SPI_execute_with_args(deletes[i], 1, (Oid[]) {TEXTOID},
												values, NULL, false, 0);

		if (ret != SPI_OK_DELETE)
			elog(ERROR, "outbox: \"%s\" failed: %s", deletes[i], SPI_result_code_string(ret));
		counts[i] = SPI_processed;
	}
	SPI_finish();
	inbox_switch_back(save_userid, save_sec);
	if (counts[1] > 0 || counts[2] > 0)
		ereport(WARNING,
				(errmsg("subscription \"%s\" dropped with %llu queued events and %llu dead letters",
						name, (unsigned long long) counts[1], (unsigned long long) counts[2])));
	outbox_inbox_wake_at_commit();
	PG_RETURN_VOID();
}
