/*-------------------------------------------------------------------------
 *
 * capture.c
 *	  outbox.capture(): a trigger that turns row changes into events.
 *
 *	  CREATE TRIGGER orders_outbox
 *		  AFTER INSERT OR UPDATE OR DELETE ON orders
 *		  FOR EACH ROW EXECUTE FUNCTION outbox.capture('order', 'id');
 *
 * Each fired row becomes one event, written with the same code as emit()
 * in the same transaction, so a rolled-back change never publishes.
 *
 *	event_type		<table>.created, <table>.updated or <table>.deleted,
 *					where <table> is the table the change happened in, or
 *					the root of its partition tree for a partition
 *	aggregate_id	the key column(s) of the new row (the old one for a
 *					DELETE); with several columns, their text values joined
 *					by ':', each with '\' and ':' escaped by a '\', so that
 *					different keys never give the same id
 *	payload			{"op": "created"|"updated"|"deleted",
 *					 "table": "<schema>.<table>" (quoted as SQL needs),
 *					 "before": <old row> | null, "after": <new row> | null}
 *					rows as row_to_json() renders them: every column by
 *					name, numeric exact, timestamps ISO 8601 in UTC, bytea
 *					as "\x..." hex, arrays as JSON arrays, NULL as null
 *
 * An UPDATE that changes the key becomes two events, <table>.deleted under
 * the old key and <table>.created under the new one (as Debezium does), so
 * that every key's history ends with its last state: consumers would
 * otherwise keep the row under the old key as live.  No tombstone follows
 * a deleted event (README: compacted topics).
 *
 * Keys and rows are rendered with fixed output settings (render_settings),
 * not the writing session's: a key is the Kafka message key, and one row
 * must give the same key, hence the same partition and the same order,
 * whatever DateStyle or TimeZone the session happens to use.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "write/emit.h"

#include "catalog/partition.h"
#include "commands/trigger.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "pgtime.h"
#include "utils/json.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"

PG_FUNCTION_INFO_V1(outbox_capture);

/*
 * Output settings under which keys and rows are rendered, whatever the
 * session set: the defaults of a fresh cluster, with TimeZone UTC (as
 * pg_dump fixes its own output settings).
 */
#define RENDER_TIMEZONE 0
static const char *const render_settings[][2] = {
	{"TimeZone", "UTC"},
	{"DateStyle", "ISO, MDY"},
	{"IntervalStyle", "postgres"},
	{"bytea_output", "hex"},
	{"extra_float_digits", "1"},
	{"lc_monetary", "C"},
};

static bool timezone_is_utc(void);
static char *trigger_context(TriggerData *trigdata);
static void rendering_error_context(void *arg);
static int	set_render_settings(void);
static void build_event(OutboxEvent *event, TriggerData *trigdata, Oid root,
						const char *op, HeapTuple before, HeapTuple after,
						text *aggregate_id);
static List *key_attnums(TupleDesc tupdesc, const char *key_columns,
						 const char *context);
static text *aggregate_id_of(HeapTuple tuple, TupleDesc tupdesc, List *attnums,
							 const char *context);
static void append_row_json(StringInfo buf, HeapTuple tuple, TupleDesc tupdesc);

/*
 * outbox_capture
 *		Trigger function: AFTER INSERT OR UPDATE OR DELETE ... FOR EACH ROW
 *		EXECUTE FUNCTION outbox.capture(aggregate_type, key_columns
 *		[, topic]).
 *
 * key_columns is one column name or several separated by commas; topic is
 * optional (empty or absent = routed by aggregate_type).  Errors name the
 * trigger and table:
 *	42P17 (invalid_object_definition): not AFTER ... FOR EACH ROW, TRUNCATE,
 *		  wrong number of arguments, empty aggregate type or key list;
 *	42703 (undefined_column): a key column the table does not have;
 *	22004 (null_value_not_allowed): a key column is NULL in the row;
 *	22023 (invalid_parameter_value): the one key column is empty in the row;
 *	22023, 42501: the topic, as for outbox.emit().
 */
Datum
outbox_capture(PG_FUNCTION_ARGS)
{
	TriggerData *trigdata = (TriggerData *) fcinfo->context;
	Trigger    *trigger;
	Relation	rel;
	char	   *context;
	Oid			root;
	HeapTuple	before = NULL;
	HeapTuple	after = NULL;
	TupleDesc	tupdesc;
	List	   *attnums;
	text	   *aggregate_type;
	text	   *topic;
	text	   *old_key = NULL;
	text	   *new_key = NULL;
	OutboxEvent events[2];
	int			nevents = 1;
	Oid			save_userid;
	int			save_sec_context;
	int			save_nestlevel;
	ErrorContextCallback rendering;
	int			i;

	if (!CALLED_AS_TRIGGER(fcinfo))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("outbox.capture() can only be called as a trigger")));

	trigger = trigdata->tg_trigger;
	rel = trigdata->tg_relation;
	tupdesc = RelationGetDescr(rel);
	context = trigger_context(trigdata);

	if (!TRIGGER_FIRED_AFTER(trigdata->tg_event) ||
		!TRIGGER_FIRED_FOR_ROW(trigdata->tg_event) ||
		TRIGGER_FIRED_BY_TRUNCATE(trigdata->tg_event))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_OBJECT_DEFINITION),
				 errmsg("%soutbox.capture() must be fired AFTER INSERT, UPDATE or DELETE ... FOR EACH ROW",
						context)));
	if (trigger->tgnargs < 2 || trigger->tgnargs > 3)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_OBJECT_DEFINITION),
				 errmsg("%soutbox.capture() takes 2 or 3 arguments, got %d",
						context, trigger->tgnargs),
				 errhint("EXECUTE FUNCTION outbox.capture('aggregate_type', 'key_column[,key_column...]' [, 'topic'])")));
	if (trigger->tgargs[0][0] == '\0')
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_OBJECT_DEFINITION),
				 errmsg("%sthe aggregate type (argument 1) must not be empty", context)));
	if (trigger->tgnargs == 3 && trigger->tgargs[2][0] == '\0')
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_OBJECT_DEFINITION),
				 errmsg("%sthe topic (argument 3) must not be empty", context),
				 errhint("Leave the argument out to route events by aggregate type.")));

	if (TRIGGER_FIRED_BY_INSERT(trigdata->tg_event))
		after = trigdata->tg_trigtuple;
	else
	{
		before = trigdata->tg_trigtuple;
		if (TRIGGER_FIRED_BY_UPDATE(trigdata->tg_event))
			after = trigdata->tg_newtuple;
	}
	/* parsed once per row, also when an UPDATE renders two keys */
	attnums = key_attnums(tupdesc, trigger->tgargs[1], context);
	aggregate_type = cstring_to_text(trigger->tgargs[0]);
	topic = trigger->tgnargs == 3 ? cstring_to_text(trigger->tgargs[2]) : NULL;
	outbox_validate_topic(topic, aggregate_type, context);

	/* a partition reports as the partitioned table it belongs to */
	root = RelationGetRelid(rel);
	if (rel->rd_rel->relispartition)
		root = llast_oid(get_partition_ancestors(root));

	/*
	 * capture() runs as the extension's owner (SECURITY DEFINER), but
	 * rendering the row calls code the table's owner may have written: casts
	 * to json of its own types, output functions.  Run that as the table's
	 * owner, in a security-restricted operation (as PostgreSQL does for
	 * index expressions), so that it never gains the extension owner's
	 * rights.  The output settings are set at a new GUC nest level, undone
	 * below; an error undoes both with the transaction's abort.
	 */
	GetUserIdAndSecContext(&save_userid, &save_sec_context);
	SetUserIdAndSecContext(rel->rd_rel->relowner,
						   save_sec_context | SECURITY_LOCAL_USERID_CHANGE |
						   SECURITY_RESTRICTED_OPERATION);
	save_nestlevel = set_render_settings();

	/* an error while rendering (jsonb refuses a json column's \u0000) names us */
	rendering.callback = rendering_error_context;
	rendering.arg = context;
	rendering.previous = error_context_stack;
	error_context_stack = &rendering;

	if (before)
		old_key = aggregate_id_of(before, tupdesc, attnums, context);
	if (after)
		new_key = aggregate_id_of(after, tupdesc, attnums, context);

	/* keys are compared byte for byte: a Kafka key is bytes */
	if (before && after &&
		(VARSIZE_ANY_EXHDR(old_key) != VARSIZE_ANY_EXHDR(new_key) ||
		 memcmp(VARDATA_ANY(old_key), VARDATA_ANY(new_key),
				VARSIZE_ANY_EXHDR(old_key)) != 0))
	{
		/* the key changed: end the old key's history, start the new one's */
		build_event(&events[0], trigdata, root, "deleted", before, NULL, old_key);
		build_event(&events[1], trigdata, root, "created", NULL, after, new_key);
		nevents = 2;
	}
	else
		build_event(&events[0], trigdata, root,
					before && after ? "updated" : after ? "created" : "deleted",
					before, after, after ? new_key : old_key);

	error_context_stack = rendering.previous;
	AtEOXact_GUC(true, save_nestlevel);
	SetUserIdAndSecContext(save_userid, save_sec_context);

	/* inserted as the extension's owner: the table's owner needs no grant */
	for (i = 0; i < nevents; i++)
	{
		events[i].aggregate_type = aggregate_type;
		events[i].topic = topic;
		outbox_insert_event(&events[i], context);
	}

	return PointerGetDatum(NULL);
}

/*
 * set_render_settings
 *		Set render_settings at a new GUC nest level and return it, for
 *		AtEOXact_GUC() to undo.  Only settings that differ are set: setting
 *		one costs a little (TimeZone, lc_monetary), and this runs per row.
 */
static int
set_render_settings(void)
{
	int			nestlevel = NewGUCNestLevel();
	size_t		i;

	for (i = 0; i < lengthof(render_settings); i++)
	{
		const char *current = GetConfigOption(render_settings[i][0], false, false);

		if (current != NULL && strcmp(current, render_settings[i][1]) == 0)
			continue;
		if (i == RENDER_TIMEZONE && timezone_is_utc())
			continue;
		(void) set_config_option(render_settings[i][0], render_settings[i][1],
								 PGC_USERSET, PGC_S_SESSION, GUC_ACTION_SAVE,
								 true, 0, false);
	}
	return nestlevel;
}

/*
 * build_event
 *		Fill *event's key, type and payload for one event of a captured row
 *		change (the caller sets aggregate_type and topic).
 *
 * op is "created", "updated" or "deleted"; before/after are the old and new
 * row or NULL; aggregate_id is the rendered key.  Called with the table
 * owner's user id and the fixed output settings in place.
 */
static void
build_event(OutboxEvent *event, TriggerData *trigdata, Oid root, const char *op,
			HeapTuple before, HeapTuple after, text *aggregate_id)
{
	TupleDesc	tupdesc = RelationGetDescr(trigdata->tg_relation);
	StringInfoData payload;

	event->aggregate_id = aggregate_id;
	event->event_type = cstring_to_text(psprintf("%s.%s", get_rel_name(root), op));
	event->headers = NULL;
	event->payload_bytes = NULL;

	initStringInfo(&payload);
	appendStringInfoString(&payload, "{\"op\": ");
	escape_json(&payload, op);
	appendStringInfoString(&payload, ", \"table\": ");
	/* quoted where SQL needs quotes, so that dots in names stay unambiguous */
	escape_json(&payload,
				quote_qualified_identifier(get_namespace_name(get_rel_namespace(root)),
										   get_rel_name(root)));
	appendStringInfoString(&payload, ", \"before\": ");
	append_row_json(&payload, before, tupdesc);
	appendStringInfoString(&payload, ", \"after\": ");
	append_row_json(&payload, after, tupdesc);
	appendStringInfoChar(&payload, '}');
	event->payload = DatumGetJsonbP(DirectFunctionCall1(jsonb_in,
														CStringGetDatum(payload.data)));
}

/*
 * True if the session's time zone renders timestamps as UTC does: a zone
 * with a fixed offset of 0 (UTC, Etc/UTC, GMT, Zulu...).  With DateStyle
 * ISO only the offset is printed, never the zone's name.
 */
static bool
timezone_is_utc(void)
{
	long int	gmtoff;

	return session_timezone != NULL &&
		pg_get_timezone_offset(session_timezone, &gmtoff) && gmtoff == 0;
}

/*
 * Error context while a row is rendered for its event: which trigger on
 * which table (arg, from trigger_context) was capturing it.
 */
static void
rendering_error_context(void *arg)
{
	errcontext("%scapturing the row as an event (outbox.capture())", (const char *) arg);
}

/*
 * "trigger "<name>" on table "<table>": ", the prefix of capture()'s
 * messages.
 */
static char *
trigger_context(TriggerData *trigdata)
{
	return psprintf("trigger \"%s\" on table \"%s\": ",
					trigdata->tg_trigger->tgname,
					RelationGetRelationName(trigdata->tg_relation));
}

/*
 * Append one key value to the aggregate id, escaping the separator.
 */
static void
append_escaped(StringInfo buf, const char *value)
{
	for (; *value; value++)
	{
		if (*value == '\\' || *value == ':')
			appendStringInfoChar(buf, '\\');
		appendStringInfoChar(buf, *value);
	}
}

/*
 * key_attnums
 *		The attribute numbers of the key columns listed in key_columns
 *		(trigger argument 2: names separated by commas, blanks around them
 *		ignored), in list order.
 *
 * Raises 42P17 for an empty list, an empty item or a column listed twice,
 * 42703 for a column the table does not have; messages start with context.
 */
static List *
key_attnums(TupleDesc tupdesc, const char *key_columns, const char *context)
{
	char	   *copy = pstrdup(key_columns);
	char	   *saveptr = NULL;
	char	   *name;
	List	   *attnums = NIL;
	int			commas = 0;
	const char *c;

	for (name = strtok_r(copy, ",", &saveptr); name != NULL;
		 name = strtok_r(NULL, ",", &saveptr))
	{
		int			attnum;

		while (*name == ' ')
			name++;
		while (*name && name[strlen(name) - 1] == ' ')
			name[strlen(name) - 1] = '\0';
		if (*name == '\0')
			continue;
		attnum = SPI_fnumber(tupdesc, name);
		if (attnum == SPI_ERROR_NOATTRIBUTE || attnum <= 0)
			ereport(ERROR,
					(errcode(ERRCODE_UNDEFINED_COLUMN),
					 errmsg("%skey column \"%s\" does not exist", context, name),
					 errhint("The second argument of outbox.capture() lists the key columns, separated by commas.")));
		if (list_member_int(attnums, attnum))
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_OBJECT_DEFINITION),
					 errmsg("%skey column \"%s\" is listed twice", context, name)));
		attnums = lappend_int(attnums, attnum);
	}
	if (attnums == NIL)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_OBJECT_DEFINITION),
				 errmsg("%sthe key columns (argument 2) must name at least one column", context)));
	/* strtok_r passes over empty items ("id,,b"): count the commas */
	for (c = key_columns; *c; c++)
		commas += (*c == ',');
	if (list_length(attnums) != commas + 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_OBJECT_DEFINITION),
				 errmsg("%sthe key columns (argument 2) contain an empty item", context),
				 errhint("List the key columns separated by single commas, e.g. 'order_id,line'.")));
	return attnums;
}

/*
 * aggregate_id_of
 *		The aggregate id: the text form of the key columns (attnums, from
 *		key_attnums()) of tuple.  Raises 22004 if one is NULL, 22023 if
 *		the only one is empty (several never make an empty id: they are
 *		joined with ':').
 */
static text *
aggregate_id_of(HeapTuple tuple, TupleDesc tupdesc, List *attnums,
				const char *context)
{
	StringInfoData id;
	ListCell   *lc;

	initStringInfo(&id);
	foreach(lc, attnums)
	{
		int			attnum = lfirst_int(lc);
		char	   *value = SPI_getvalue(tuple, tupdesc, attnum);

		if (value == NULL)
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("%skey column \"%s\" is null", context,
							NameStr(TupleDescAttr(tupdesc, attnum - 1)->attname)),
					 errdetail("The key columns make the event's aggregate id, which cannot be null.")));
		if (list_length(attnums) == 1)
		{
			/* as outbox.emit() refuses an empty aggregate_id */
			if (value[0] == '\0')
				ereport(ERROR,
						(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
						 errmsg("%skey column \"%s\" is empty", context,
								NameStr(TupleDescAttr(tupdesc, attnum - 1)->attname)),
						 errdetail("The key column makes the event's aggregate id, the Kafka message key, which cannot be empty.")));
			return cstring_to_text(value);
		}
		if (foreach_current_index(lc) > 0)
			appendStringInfoChar(&id, ':');
		append_escaped(&id, value);
	}
	return cstring_to_text(id.data);
}

/*
 * Append the row as a JSON object (row_to_json), or null.
 */
static void
append_row_json(StringInfo buf, HeapTuple tuple, TupleDesc tupdesc)
{
	Datum		row;
	Datum		json;

	if (tuple == NULL)
	{
		appendStringInfoString(buf, "null");
		return;
	}
	row = heap_copy_tuple_as_datum(tuple, tupdesc);
	json = DirectFunctionCall1(row_to_json, row);
	appendStringInfoString(buf, text_to_cstring(DatumGetTextPP(json)));
}
