/*-------------------------------------------------------------------------
 *
 * emit.c
 *	  outbox.emit(): write one event in the caller's transaction.
 *
 * The event row is inserted with SPI in the calling transaction, so it
 * commits or rolls back together with the caller's business rows.  Nothing
 * is sent from here: publishing is the relay worker's job, and it only ever
 * sees committed rows.  What emit() adds on top of a plain INSERT is
 *	- validation of every argument before anything is written, so a bad
 *	  event fails the caller's transaction now instead of the relay later;
 *	- a wake-up of the relay at commit, so the event goes out within
 *	  milliseconds instead of at the next poll.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "write/emit.h"
#include "config/cloudevents.h"
#include "config/guc.h"
#include "config/topic.h"
#include "shared/partition.h"
#include "shared/shmem.h"
#include "write/trace_context.h"

#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/namespace.h"
#include "catalog/pg_type.h"
#include "utils/lsyscache.h"
#include "utils/timestamp.h"
#include "utils/xid8.h"
#include "commands/dbcommands.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "tcop/utility.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"
#include "utils/uuid.h"

PG_FUNCTION_INFO_V1(outbox_emit);
PG_FUNCTION_INFO_V1(outbox_emit_bytes);

/* set by emit(), consumed by the transaction callback */
static bool wake_at_commit = false;
static bool control_at_commit = false;
static bool xact_callback_registered = false;

/*
 * INSERT plans, prepared once per backend: [with_xid][with_bytes], the xid
 * for events tracked by snapshot (schema 1.4), the bytes of emit_bytes()
 * (1.6; emit() leaves the column out, so that it works with older schemas)
 */
static SPIPlanPtr insert_plans[2][2];

/* this database's events may carry their xid: see snapshot_tracking_ready */
static bool snapshot_ready = false;
static TimestampTz snapshot_checked_at = 0;

/* how often a backend looks again after the answer was no, ms */
#define SNAPSHOT_RECHECK_MS 10000

/* warn_if_not_relayed() has run in this backend */
static bool relay_checked = false;

static void outbox_xact_callback(XactEvent event, void *arg);
static void warn_if_not_relayed(void);
static text *required_text_arg(FunctionCallInfo fcinfo, int argno,
							   const char *name, const char *function);
static void event_from_args(FunctionCallInfo fcinfo, const char *function,
							OutboxEvent *event);
static void validate_headers(Jsonb *headers);
static void check_length(text *value, const char *name, int max,
						 const char *context);
static const char *jsonb_type_name(JsonbValue *v);

/*
 * outbox_register_wakeup_at_commit
 *		Make the current transaction wake the relay worker when it commits.
 *
 * A rolled-back transaction wakes nobody.  A prepared transaction (2PC) is
 * committed later, possibly by another session, so it relies on the relay's
 * poll interval instead.  control: see outbox_wake_worker().
 */
void
outbox_register_wakeup_at_commit(bool control)
{
	if (!xact_callback_registered)
	{
		RegisterXactCallback(outbox_xact_callback, NULL);
		xact_callback_registered = true;
	}
	wake_at_commit = true;
	control_at_commit |= control;
}

static void
outbox_xact_callback(XactEvent event, void *arg)
{
	switch (event)
	{
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PARALLEL_COMMIT:
			if (wake_at_commit)
				outbox_wake_worker(control_at_commit);
			wake_at_commit = false;
			control_at_commit = false;
			break;
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
		case XACT_EVENT_PREPARE:
			wake_at_commit = false;
			control_at_commit = false;
			break;
		default:
			break;
	}
}

/*
 * outbox_emit
 *		SQL: outbox.emit(aggregate_type text, aggregate_id text,
 *						 event_type text, payload jsonb,
 *						 headers jsonb DEFAULT NULL, topic text DEFAULT NULL)
 *						 RETURNS uuid
 *
 * Inserts one row into outbox.events in the caller's transaction and returns
 * its event_id.  payload NULL makes the event a Kafka tombstone.
 *
 * Errors, raised before anything is written:
 *	22004 (null_value_not_allowed): aggregate_type, aggregate_id or
 *		  event_type is NULL;
 *	22023 (invalid_parameter_value): one of them is empty; headers is not a
 *		  JSON object of string values or uses a reserved name; topic (or,
 *		  when topic is NULL, outbox.topic_prefix || aggregate_type) is not a
 *		  legal Kafka topic name;
 *	22001 (string_data_right_truncation): aggregate_type is longer than 255
 *		  bytes or aggregate_id longer than 1024 bytes;
 *	42501 (insufficient_privilege): outbox.allowed_topics does not allow
 *		  the topic.
 */
Datum
outbox_emit(PG_FUNCTION_ARGS)
{
	OutboxEvent event;

	event_from_args(fcinfo, "outbox.emit()", &event);
	event.payload = PG_ARGISNULL(3) ? NULL : PG_GETARG_JSONB_P(3);
	PG_RETURN_POINTER(outbox_insert_event(&event, NULL));
}

/*
 * outbox_emit_bytes
 *		SQL: outbox.emit_bytes(aggregate_type text, aggregate_id text,
 *							   event_type text, payload bytea,
 *							   headers jsonb DEFAULT NULL,
 *							   topic text DEFAULT NULL) RETURNS uuid
 *
 * As outbox_emit, with a value the relay sends byte for byte (e.g. Avro or
 * Protobuf in the Confluent wire format, serialized by the application);
 * payload NULL makes a tombstone.  Same errors as outbox_emit.  Schema 1.6.
 */
Datum
outbox_emit_bytes(PG_FUNCTION_ARGS)
{
	OutboxEvent event;

	event_from_args(fcinfo, "outbox.emit_bytes()", &event);
	event.payload_bytes = PG_ARGISNULL(3) ? NULL : PG_GETARG_BYTEA_PP(3);
	PG_RETURN_POINTER(outbox_insert_event(&event, NULL));
}

/*
 * The arguments emit() and emit_bytes() share (all but the payload, which
 * is left NULL), checked: see outbox_emit for the errors, whose hints name
 * function.
 */
static void
event_from_args(FunctionCallInfo fcinfo, const char *function,
				OutboxEvent *event)
{
	event->aggregate_type = required_text_arg(fcinfo, 0, "aggregate_type", function);
	event->aggregate_id = required_text_arg(fcinfo, 1, "aggregate_id", function);
	event->event_type = required_text_arg(fcinfo, 2, "event_type", function);
	event->payload = NULL;
	event->payload_bytes = NULL;
	event->headers = PG_ARGISNULL(4) ? NULL : PG_GETARG_JSONB_P(4);
	event->topic = PG_ARGISNULL(5) ? NULL : PG_GETARG_TEXT_PP(5);

	if (event->headers != NULL)
		validate_headers(event->headers);
	outbox_validate_topic(event->topic, event->aggregate_type, NULL);
}

/*
 * warn_if_not_relayed
 *		Once per backend, at its first event: WARNING if no relay will ever
 *		publish what this database's outbox holds.
 *
 * emit() still succeeds there (a copy of the production database must stay
 * writable, and the events wait in the table for a relay), but a silent
 * success would let events pile up unnoticed.  The relay serves one
 * database, outbox.database, and runs only if the library was preloaded.
 */
static void
warn_if_not_relayed(void)
{
	char	   *dbname = NULL;
	OutboxRelayCoverage coverage = outbox_relay_coverage(&dbname);

	relay_checked = true;
	if (coverage == OUTBOX_NOT_PRELOADED)
		ereport(WARNING,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("outbox events are stored but not published: the outbox library is not in shared_preload_libraries"),
				 errhint("Add 'outbox' to shared_preload_libraries and restart the server; the events wait in outbox.events until then.")));
	else if (coverage == OUTBOX_OTHER_DATABASE && outbox_databases[0] != '\0')
		ereport(WARNING,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("outbox events emitted in database \"%s\" are not published", dbname),
				 errdetail("The relays serve the databases of outbox.databases only: %s.",
						   outbox_databases),
				 errhint("Emit in one of those databases, or add \"%s\" to outbox.databases and reload the configuration.",
						 dbname)));
	else if (coverage == OUTBOX_OTHER_DATABASE)
		ereport(WARNING,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("outbox events emitted in database \"%s\" are not published", dbname),
				 errdetail("The relay publishes the events of database \"%s\" only (outbox.database).",
						   outbox_database),
				 errhint("Emit in database \"%s\", or set outbox.database = '%s' and restart the server.",
						 outbox_database, dbname)));
	else if (coverage == OUTBOX_UNSERVABLE_DATABASE)
		ereport(WARNING,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("outbox events emitted in database \"%s\" are not published", dbname),
				 errdetail("It is a template or does not accept connections, so no relay can connect to it."),
				 errhint("ALTER DATABASE \"%s\" IS_TEMPLATE false ALLOW_CONNECTIONS true, or emit in another database.",
						 dbname)));
}

/*
 * Prepare (once per backend) the INSERT of an event, with the xid column
 * (schema 1.4, outbox.relay_mode = snapshot) or without, and with the
 * payload_bytes column (1.6, emit_bytes()) or without.  Every name is
 * schema-qualified: search_path plays no part.  The parameters are always
 * the eight of outbox_insert_event; $7 (bytes) and $8 (xid) are left unused
 * by the variants without them.
 */
static SPIPlanPtr
prepare_insert(bool with_xid, bool with_bytes)
{
	SPIPlanPtr *cache = &insert_plans[with_xid][with_bytes];
	Oid			argtypes[8] = {TEXTOID, TEXTOID, TEXTOID, JSONBOID, JSONBOID, TEXTOID,
	BYTEAOID, XID8OID};

	if (*cache == NULL)
	{
		SPIPlanPtr	plan;

		plan = SPI_prepare(psprintf("INSERT INTO outbox.events"
									" (aggregate_type, aggregate_id, event_type, payload, headers, topic%s%s)"
									" VALUES ($1, $2, $3, $4, $5, $6%s%s) RETURNING event_id",
									with_bytes ? ", payload_bytes" : "",
									with_xid ? ", xid" : "",
									with_bytes ? ", $7" : "",
									with_xid ? ", $8" : ""),
						   8, argtypes);
		if (plan == NULL)
			elog(ERROR, "outbox: SPI_prepare failed: %s",
				 SPI_result_code_string(SPI_result));
		SPI_keepplan(plan);
		*cache = plan;
	}
	return *cache;
}

/*
 * May this backend's events be tracked by snapshot?  Only when the schema
 * has outbox.relay_progress (1.4) and its one row was written in this
 * cluster: after a pg_dump/pg_restore into another cluster the restored row
 * names the source's system identifier, the relay has not yet converted the
 * restored events (see snapshot.c), and new events are written the row way
 * until it has.  A yes is kept for the backend's life; a no is asked again
 * every SNAPSHOT_RECHECK_MS.  Runs inside SPI.
 */
static bool
snapshot_tracking_ready(void)
{
	TimestampTz now;
	Oid			nsp;

	if (snapshot_ready)
		return true;
	now = GetCurrentTimestamp();
	if (!TimestampDifferenceExceeds(snapshot_checked_at, now, SNAPSHOT_RECHECK_MS))
		return false;
	snapshot_checked_at = now;
	nsp = get_namespace_oid(OUTBOX_SCHEMA, true);
	if (!OidIsValid(nsp) || !OidIsValid(get_relname_relid("relay_progress", nsp)))
		return false;
	if (SPI_execute("SELECT system_identifier FROM outbox.relay_progress",
					true, 2) != SPI_OK_SELECT)
		elog(ERROR, "outbox: could not read outbox.relay_progress");
	if (SPI_processed == 1)
	{
		bool		isnull;
		Datum		d = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc,
									  1, &isnull);

		snapshot_ready = !isnull &&
			DatumGetInt64(d) == (int64) GetSystemIdentifier();
	}
	return snapshot_ready;
}

/*
 * outbox_insert_event
 *		Insert one validated event into outbox.events in the current
 *		transaction and make its commit wake the relay.  Events without a
 *		traceparent header get the session's or statement's trace context
 *		(outbox_add_trace_context).
 *
 * The caller has checked the arguments (outbox_validate_topic() for the
 * topic); the lengths of aggregate_type and aggregate_id are checked here,
 * for every caller (22001, messages prefixed by context if not NULL: the
 * trigger capture names its trigger and table).  Returns the new event_id,
 * palloc'd in the caller's context.  Raises ERROR if the INSERT fails (e.g.
 * the extension is being dropped).  The first event of a backend may raise
 * a WARNING when no relay publishes this database (warn_if_not_relayed).
 */
pg_uuid_t *
outbox_insert_event(const OutboxEvent *event, const char *context)
{
	Datum		values[8];
	char		nulls[8];
	Jsonb	   *headers;
	bool		with_xid;
	bool		isnull;
	Datum		event_id;
	pg_uuid_t  *result;
	int			ret;

	check_length(event->aggregate_type, "aggregate_type", OUTBOX_AGGREGATE_TYPE_MAX_BYTES, context);
	check_length(event->aggregate_id, "aggregate_id", OUTBOX_AGGREGATE_ID_MAX_BYTES, context);
	if (!relay_checked)
		warn_if_not_relayed();
	headers = outbox_add_trace_context(event->headers);

	values[0] = PointerGetDatum(event->aggregate_type);
	values[1] = PointerGetDatum(event->aggregate_id);
	values[2] = PointerGetDatum(event->event_type);
	values[3] = PointerGetDatum(event->payload);
	values[4] = PointerGetDatum(headers);
	values[5] = PointerGetDatum(event->topic);
	values[6] = PointerGetDatum(event->payload_bytes);
	values[7] = (Datum) 0;
	nulls[0] = nulls[1] = nulls[2] = ' ';
	nulls[3] = event->payload == NULL ? 'n' : ' ';
	nulls[4] = headers == NULL ? 'n' : ' ';
	nulls[5] = event->topic == NULL ? 'n' : ' ';
	nulls[6] = event->payload_bytes == NULL ? 'n' : ' ';
	nulls[7] = 'n';

	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "outbox: SPI_connect failed");

	with_xid = !outbox_rows_for_new_events() && snapshot_tracking_ready();
	if (with_xid)
	{
		/*
		 * The transaction gets its xid before the event takes its id from
		 * the sequence: the relay's batches rely on that order (snapshot.c).
		 * A read-only transaction (a hot standby's too) must get the INSERT's
		 * own error (25006), not the xid assignment's internal one.
		 */
		PreventCommandIfReadOnly("INSERT");
		values[7] = FullTransactionIdGetDatum(GetTopFullTransactionId());
		nulls[7] = ' ';
	}
	ret = SPI_execute_plan(prepare_insert(with_xid, event->payload_bytes != NULL),
						   values, nulls, false, 1);
	if (ret != SPI_OK_INSERT_RETURNING || SPI_processed != 1)
		elog(ERROR, "outbox: INSERT into outbox.events failed: %s",
			 SPI_result_code_string(ret));

	/* the uuid is pass-by-reference: copy it out of SPI's memory */
	event_id = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1,
							 &isnull);
	result = SPI_palloc(UUID_LEN);
	memcpy(result, DatumGetPointer(event_id), UUID_LEN);
	SPI_finish();

	outbox_register_wakeup_at_commit(false);
	return result;
}

/*
 * An aggregate type or id longer than max bytes would fail later, in the
 * relay's index (see OUTBOX_AGGREGATE_ID_MAX_BYTES): refuse it now.
 */
static void
check_length(text *value, const char *name, int max, const char *context)
{
	int			len = VARSIZE_ANY_EXHDR(value);

	if (len > max)
		ereport(ERROR,
				(errcode(ERRCODE_STRING_DATA_RIGHT_TRUNCATION),
				 errmsg("%s%s is too long", context ? context : "", name),
				 errdetail("It is %d bytes; at most %d bytes are allowed.", len, max),
				 errhint("Use a shorter identifier, e.g. a hash of it.")));
}

/*
 * Fetch a text argument that must be neither NULL nor empty.
 */
static text *
required_text_arg(FunctionCallInfo fcinfo, int argno, const char *name,
				  const char *function)
{
	text	   *t;

	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("%s must not be null", name),
				 errhint("%s needs aggregate_type, aggregate_id and event_type.", function)));
	t = PG_GETARG_TEXT_PP(argno);
	if (VARSIZE_ANY_EXHDR(t) == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must not be empty", name)));
	return t;
}

/*
 * Kafka header values are byte strings; we accept a flat JSON object whose
 * values are JSON strings, so that what arrives is exactly what was written.
 */
static void
validate_headers(Jsonb *headers)
{
	JsonbIterator *it;
	JsonbValue	v;
	JsonbIteratorToken tok;
	char	   *key = NULL;
	bool		has_traceparent = false;
	bool		has_tracestate = false;

	if (!JB_ROOT_IS_OBJECT(headers) || JB_ROOT_IS_SCALAR(headers))
	{
		const char *got = "an array";

		if (JB_ROOT_IS_SCALAR(headers) &&
			JsonbExtractScalar(&headers->root, &v))
			got = jsonb_type_name(&v);
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("headers must be a JSON object"),
				 errdetail("Got %s.", got),
				 errhint("Pass headers as an object of string values, e.g. '{\"traceparent\": \"00-...\"}'.")));
	}

	it = JsonbIteratorInit(&headers->root);
	while ((tok = JsonbIteratorNext(&it, &v, true)) != WJB_DONE)
	{
		if (tok == WJB_KEY)
		{
			key = pnstrdup(v.val.string.val, v.val.string.len);
			has_traceparent |= strcmp(key, "traceparent") == 0;
			has_tracestate |= strcmp(key, "tracestate") == 0;
			if (v.val.string.len == 0)
				ereport(ERROR,
						(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
						 errmsg("headers must not contain an empty key")));
			if (strcmp(key, OUTBOX_HEADER_ID) == 0 ||
				strcmp(key, OUTBOX_HEADER_EVENT_TYPE) == 0 ||
				strcmp(key, OUTBOX_HEADER_AGGREGATE_TYPE) == 0 ||
				strcmp(key, OUTBOX_HEADER_CE_ID) == 0 ||
				strcmp(key, OUTBOX_HEADER_CE_SPECVERSION) == 0)
				ereport(ERROR,
						(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
						 errmsg("headers must not contain the reserved key \"%s\"", key),
						 errdetail("The relay sets the headers \"id\", \"event_type\", \"aggregate_type\", \"ce_id\" and \"ce_specversion\" itself.")));
		}
		else if (tok == WJB_VALUE && v.type != jbvString)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("headers value for key \"%s\" must be a JSON string", key),
					 errdetail("Got %s.", jsonb_type_name(&v)),
					 errhint("Kafka header values are strings; quote the value.")));
		else if (tok == WJB_VALUE)
		{
			outbox_check_trace_header(key, v.val.string.val, v.val.string.len);
			outbox_check_cloudevents_header(key, v.val.string.val, v.val.string.len);
		}
	}
	if (has_tracestate && !has_traceparent)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("headers has a \"tracestate\" but no \"traceparent\""),
				 errdetail("A W3C tracestate belongs to the traceparent it came with."),
				 errhint("Pass both, or neither.")));
}

static const char *
jsonb_type_name(JsonbValue *v)
{
	switch (v->type)
	{
		case jbvNull:
			return "null";
		case jbvNumeric:
			return "a number";
		case jbvBool:
			return "a boolean";
		case jbvString:
			return "a string";
		case jbvBinary:
			return "an object or array";
		default:
			return "a non-string value";
	}
}

/*
 * outbox_validate_topic
 *		Check the event's topic: the explicit one, or the routed one
 *		(outbox.topic_prefix || aggregate_type) when topic is NULL.  It must
 *		be a legal Kafka topic name (22023), not one of Kafka's internal
 *		topics (22023) nor outbox.progress_topic (42501), and allowed by
 *		outbox.allowed_topics (42501).  context, if not NULL, is prefixed to
 *		the messages (the trigger capture names its trigger and table).
 */
void
outbox_validate_topic(text *topic, text *aggregate_type, const char *context)
{
	char	   *name;

	if (context == NULL)
		context = "";
	if (topic != NULL)
	{
		name = text_to_cstring(topic);
		if (!outbox_topic_is_legal(VARDATA_ANY(topic), VARSIZE_ANY_EXHDR(topic)))
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("%stopic \"%s\" is not a legal Kafka topic name",
							context, name),
					 errdetail("Kafka topic names are 1 to %d characters of ASCII letters, digits, '.', '_' and '-', and not \".\" or \"..\".",
							   OUTBOX_TOPIC_MAX_LEN)));
	}
	else
	{
		name = outbox_routed_topic(outbox_topic_prefix,
								   text_to_cstring(aggregate_type));
		if (!outbox_topic_is_legal(name, strlen(name)))
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("%saggregate_type \"%s\" routes to \"%s\", which is not a legal Kafka topic name",
							context, text_to_cstring(aggregate_type), name),
					 errdetail("Kafka topic names are 1 to %d characters of ASCII letters, digits, '.', '_' and '-', and not \".\" or \"..\".",
							   OUTBOX_TOPIC_MAX_LEN),
					 errhint("Pass an explicit topic, or use an aggregate_type that fits outbox.topic_prefix (currently \"%s\").",
							 outbox_topic_prefix)));
	}

	if (outbox_topic_is_internal(name))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%stopic \"%s\" is internal to Kafka", context, name),
				 errdetail("Kafka refuses to take events for its internal topics.")));

	/* a record there could make an exactly_once relay skip events */
	if (strcmp(name, outbox_progress_topic) == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("%stopic \"%s\" is the relay's progress topic", context, name),
				 errdetail("outbox.progress_topic holds the progress records of outbox.delivery = exactly_once; an event there could make a relay skip events, or keep it from starting."),
				 errhint("Send the event to another topic. In Kafka, let only the relay's principal write to the progress topic (an ACL).")));

	if (!outbox_topic_list_allows(outbox_allowed_topic_list, name))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("%stopic \"%s\" is not allowed", context, name),
				 errdetail("outbox.allowed_topics is \"%s\".", outbox_allowed_topics),
				 errhint("A superuser can add the topic, or a prefix pattern such as \"orders.*\", to outbox.allowed_topics.")));
}
