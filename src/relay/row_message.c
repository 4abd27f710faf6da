/*-------------------------------------------------------------------------
 *
 * row_message.c
 *	  An event row becomes the fields of a Kafka message: topic (its own or
 *	  routed from the aggregate type), key, value, timestamp and headers.
 *
 * Pure building, run for every event the relay sends: nothing here talks
 * to Kafka or decides whether a row may go (message.c does both).  The
 * per-event work is kept small on purpose (a backlog drain spends most of
 * its CPU here and in jsonb's output): the row is deformed once, the value
 * is written into one reused buffer, the routed topic of the last
 * aggregate type is remembered, and the id header is formatted from the
 * uuid's bytes.  outbox.message_format picks the headers: Debezium's
 * outbox shape or CloudEvents' Kafka binding.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "relay/row_message.h"
#include "config/guc.h"
#include "config/topic.h"
#include "kafka/producer.h"
#include "relay/message.h"
#include "shared/partition.h"

#include "access/htup_details.h"
#include "access/xlog.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

/*
 * The payload's JSON text, built in one buffer that lives as long as the
 * worker (librdkafka copies it); shrunk again after an unusually large
 * payload.
 */
#define PAYLOAD_BUFFER_KEEP		(64 * 1024)
static StringInfo payload_buf = NULL;

/*
 * The topic of the last routed event (emitted without a topic): the next
 * event of the same aggregate type under the same outbox.topic_prefix, as
 * nearly every one in a backlog, reuses it and its legality check.
 */
static char *routed_prefix = NULL;
static char *routed_aggregate_type = NULL;
static char *routed_topic = NULL;
static bool routed_legal = false;

/* the header arrays of a message being built */
typedef struct HeaderList
{
	const char **names;
	const char **values;
	size_t	   *lens;
	int			n;
} HeaderList;

static void build_headers(const OutboxRow *row, const char *aggregate_type,
						  OutboxHeaderSpace *space, OutboxMessage *msg);
static void put_cloudevents_headers(HeaderList *list, const OutboxRow *row,
									const char *subject, Jsonb *headers,
									const char *event_id,
									const char *event_type, bool has_data,
									OutboxHeaderSpace *space);
static bool has_user_header(Jsonb *headers, const char *name);
static const char *cloudevents_source(void);
static void format_rfc3339(TimestampTz ts, char *buf);
static char *uuid_column(const OutboxRow *row, int col, char *buf);
static int64 timestamptz_to_unix_ms(TimestampTz ts);

/*
 * outbox_row_deform
 *		Deform tuple (a row with the claim's columns, COL_* in message.h)
 *		once into row, palloc'd in the current memory context: every column
 *		is read, and SPI_getbinval per column walks the row each time.
 */
void
outbox_row_deform(HeapTuple tuple, TupleDesc tupdesc, OutboxRow *row)
{
	Assert(tupdesc->natts >= COL_CTID);
	row->values = palloc(sizeof(Datum) * tupdesc->natts);
	row->nulls = palloc(sizeof(bool) * tupdesc->natts);
	heap_deform_tuple(tuple, tupdesc, row->values, row->nulls);
}

/*
 * outbox_row_routed_topic
 *		The topic of an event emitted without one (outbox_routed_topic of
 *		outbox.topic_prefix and aggregate_type), and in *legal whether it is
 *		a legal Kafka topic name; the last one is remembered (see
 *		routed_topic).  The result lives until the next call with another
 *		aggregate type or prefix.  Raises no error.
 */
const char *
outbox_row_routed_topic(const char *aggregate_type, bool *legal)
{
	if (routed_topic == NULL ||
		strcmp(routed_aggregate_type, aggregate_type) != 0 ||
		strcmp(routed_prefix, outbox_topic_prefix) != 0)
	{
		MemoryContext oldcxt = MemoryContextSwitchTo(TopMemoryContext);

		if (routed_topic != NULL)
		{
			pfree(routed_prefix);
			pfree(routed_aggregate_type);
			pfree(routed_topic);
		}
		routed_prefix = pstrdup(outbox_topic_prefix);
		routed_aggregate_type = pstrdup(aggregate_type);
		routed_topic = outbox_routed_topic(routed_prefix, routed_aggregate_type);
		routed_legal = outbox_topic_is_legal(routed_topic, strlen(routed_topic));
		MemoryContextSwitchTo(oldcxt);
	}
	*legal = routed_legal;
	return routed_topic;
}

/*
 * outbox_row_build_message
 *		Build the Kafka message of a claimed row for topic: the aggregate id
 *		is the key, the payload's JSON text or emit_bytes()' bytes the value
 *		(both NULL: a tombstone),
 *		created_at the timestamp (ms since the Unix epoch), then the headers
 *		(build_headers).  The header arrays live in *space, or in palloc'd
 *		memory when the row has more than 64 headers; the value in a buffer
 *		reused by the next call (librdkafka copies it).  Raises no error of
 *		its own (out of memory only).
 */
void
outbox_row_build_message(const OutboxRow *row, const char *topic,
						 const char *aggregate_type, const char *aggregate_id,
						 OutboxHeaderSpace *space, OutboxMessage *msg)
{
	msg->topic = topic;
	msg->key = aggregate_id;
	msg->key_len = strlen(aggregate_id);

	if (!ROW_ISNULL(row, COL_PAYLOAD_BYTES))
	{
		/* emit_bytes(): the bytes as they are (detoasted in the row's context) */
		bytea	   *bytes = DatumGetByteaPP(ROW_VALUE(row, COL_PAYLOAD_BYTES));

		msg->value = VARDATA_ANY(bytes);
		msg->value_len = VARSIZE_ANY_EXHDR(bytes);
	}
	else if (ROW_ISNULL(row, COL_PAYLOAD))
	{
		msg->value = NULL;		/* tombstone */
		msg->value_len = 0;
	}
	else
	{
		Jsonb	   *payload = DatumGetJsonbP(ROW_VALUE(row, COL_PAYLOAD));

		if (payload_buf == NULL || payload_buf->maxlen > PAYLOAD_BUFFER_KEEP)
		{
			MemoryContext oldcxt = MemoryContextSwitchTo(TopMemoryContext);

			if (payload_buf != NULL)
			{
				pfree(payload_buf->data);
				pfree(payload_buf);
			}
			payload_buf = makeStringInfo();
			MemoryContextSwitchTo(oldcxt);
		}
		resetStringInfo(payload_buf);
		(void) JsonbToCString(payload_buf, &payload->root, VARSIZE(payload));
		msg->value = payload_buf->data;
		msg->value_len = payload_buf->len;
	}

	msg->timestamp_ms = timestamptz_to_unix_ms(DatumGetTimestampTz(ROW_VALUE(row, COL_CREATED_AT)));

	build_headers(row, aggregate_type, space, msg);
}

static inline void
put_header(HeaderList *list, const char *name, const char *value, size_t len)
{
	list->names[list->n] = name;
	list->values[list->n] = value;
	list->lens[list->n++] = len;
}

/*
 * Set msg's headers: ours first (debezium: id, event_type, aggregate_type;
 * cloudevents: put_cloudevents_headers), then the user's, in their jsonb
 * (sorted) order.  User headers whose value is not a string are left out.
 */
static void
build_headers(const OutboxRow *row, const char *aggregate_type,
			  OutboxHeaderSpace *space, OutboxMessage *msg)
{
	HeaderList	list = {space->names, space->values, space->lens, 0};
	Jsonb	   *headers = NULL;
	char	   *event_type;
	char	   *event_id;

	event_type = outbox_row_text(row, COL_EVENT_TYPE);
	event_id = uuid_column(row, COL_EVENT_ID, space->event_id);

	if (!ROW_ISNULL(row, COL_HEADERS))
	{
		int			count;

		headers = DatumGetJsonbP(ROW_VALUE(row, COL_HEADERS));
		count = JB_ROOT_IS_OBJECT(headers) ? JB_ROOT_COUNT(headers) : 0;
		if (count > OUTBOX_USER_HEADERS_IN_PLACE)
		{
			list.names = palloc(sizeof(char *) * (count + OUTBOX_OWN_HEADERS_MAX));
			list.values = palloc(sizeof(char *) * (count + OUTBOX_OWN_HEADERS_MAX));
			list.lens = palloc(sizeof(size_t) * (count + OUTBOX_OWN_HEADERS_MAX));
		}
	}
	if (outbox_message_format == OUTBOX_FORMAT_CLOUDEVENTS)
		put_cloudevents_headers(&list, row, msg->key, headers, event_id, event_type,
								msg->value != NULL, space);
	else
	{
		put_header(&list, OUTBOX_HEADER_ID, event_id, strlen(event_id));
		put_header(&list, OUTBOX_HEADER_EVENT_TYPE, event_type, strlen(event_type));
		put_header(&list, OUTBOX_HEADER_AGGREGATE_TYPE, aggregate_type,
				   strlen(aggregate_type));
	}
	if (headers != NULL)
	{
		JsonbIterator *it = JsonbIteratorInit(&headers->root);
		JsonbValue	v;
		JsonbIteratorToken tok;
		char	   *key = NULL;

		while ((tok = JsonbIteratorNext(&it, &v, true)) != WJB_DONE)
		{
			if (tok == WJB_KEY)
				key = pnstrdup(v.val.string.val, v.val.string.len);
			else if (tok == WJB_VALUE && v.type == jbvString && key != NULL)
				put_header(&list, key, v.val.string.val, v.val.string.len);
		}
	}
	msg->nheaders = list.n;
	msg->header_names = list.names;
	msg->header_values = list.values;
	msg->header_lens = list.lens;
}

/*
 * The CloudEvents 1.0 Kafka protocol binding, binary content mode: the
 * event's attributes as ce_* headers (subject: the aggregate id), the
 * value as the event's data.  A
 * header the event's own headers also have is left to them (an emit()
 * can set its ce_source, ce_type, ce_subject, ce_time, content-type or any
 * extension), except ce_id and ce_specversion, which emit() refuses.  The
 * content-type is application/json, or application/octet-stream for the
 * bytes of emit_bytes(); a tombstone (no data) gets none.
 */
static void
put_cloudevents_headers(HeaderList *list, const OutboxRow *row,
						const char *subject, Jsonb *headers,
						const char *event_id, const char *event_type,
						bool has_data, OutboxHeaderSpace *space)
{
	const char *source = cloudevents_source();

	put_header(list, OUTBOX_HEADER_CE_SPECVERSION, "1.0", 3);
	put_header(list, OUTBOX_HEADER_CE_ID, event_id, strlen(event_id));
	if (!has_user_header(headers, "ce_source"))
		put_header(list, "ce_source", source, strlen(source));
	if (!has_user_header(headers, "ce_type"))
		put_header(list, "ce_type", event_type, strlen(event_type));
	if (!has_user_header(headers, "ce_subject"))
		put_header(list, "ce_subject", subject, strlen(subject));
	if (!has_user_header(headers, "ce_time"))
	{
		format_rfc3339(DatumGetTimestampTz(ROW_VALUE(row, COL_CREATED_AT)),
					   space->ce_time);
		put_header(list, "ce_time", space->ce_time, strlen(space->ce_time));
	}
	if (has_data && !has_user_header(headers, "content-type"))
	{
		const char *type = ROW_ISNULL(row, COL_PAYLOAD_BYTES) ?
			"application/json" : "application/octet-stream";

		put_header(list, "content-type", type, strlen(type));
	}
}

/* does the event's headers object (or NULL) have the key name? */
static bool
has_user_header(Jsonb *headers, const char *name)
{
	JsonbValue	v;

	return headers != NULL &&
		getKeyJsonValueFromContainer(&headers->root, name, strlen(name), &v) != NULL;
}

/*
 * outbox.ce_source, or when it is empty
 * /postgresql/<system identifier>/<database name, percent-encoded>: a URI
 * reference that names this database of this cluster.  The default is
 * made once per relay.
 */
static const char *
cloudevents_source(void)
{
	static char *derived = NULL;

	if (outbox_ce_source != NULL && outbox_ce_source[0] != '\0')
		return outbox_ce_source;
	if (derived == NULL)
	{
		StringInfoData buf;
		const char *p;

		initStringInfo(&buf);
		appendStringInfo(&buf, "/postgresql/" UINT64_FORMAT "/", GetSystemIdentifier());
		for (p = outbox_relay_database ? outbox_relay_database : ""; *p != '\0'; p++)
		{
			if (isalnum((unsigned char) *p) || strchr("-._~", *p) != NULL)
				appendStringInfoChar(&buf, *p);
			else
				appendStringInfo(&buf, "%%%02X", (unsigned char) *p);
		}
		derived = MemoryContextStrdup(TopMemoryContext, buf.data);
		pfree(buf.data);
	}
	return derived;
}

/*
 * ts as RFC 3339 in UTC with microseconds, e.g. 2026-12-03T04:05:06.123456Z,
 * into buf (OUTBOX_CE_TIME_LEN bytes).
 */
static void
format_rfc3339(TimestampTz ts, char *buf)
{
	struct pg_tm tm;
	fsec_t		fsec;

	if (timestamp2tm(ts, NULL, &tm, &fsec, NULL, NULL) != 0)
	{
		/* +-infinity: not possible for created_at, but never crash */
		strlcpy(buf, "1970-01-01T00:00:00Z", OUTBOX_CE_TIME_LEN);
		return;
	}
	snprintf(buf, OUTBOX_CE_TIME_LEN, "%04d-%02d-%02dT%02d:%02d:%02d.%06dZ",
			 tm.tm_year, tm.tm_mon, tm.tm_mday, tm.tm_hour, tm.tm_min,
			 tm.tm_sec, (int) fsec);
}

/*
 * outbox_row_text
 *		Column col (a text column) of row as a C string, NULL if SQL NULL.
 */
char *
outbox_row_text(const OutboxRow *row, int col)
{
	return ROW_ISNULL(row, col) ? NULL : TextDatumGetCString(ROW_VALUE(row, col));
}

/*
 * The uuid in column col as uuid_out writes it (8-4-4-4-12 lower-case hex
 * digits), in buf (UUID_LEN * 2 + 5 bytes).
 */
static char *
uuid_column(const OutboxRow *row, int col, char *buf)
{
	static const char hex[] = "0123456789abcdef";
	const pg_uuid_t *uuid = DatumGetUUIDP(ROW_VALUE(row, col));
	char	   *p = buf;
	int			i;

	for (i = 0; i < UUID_LEN; i++)
	{
		if (i == 4 || i == 6 || i == 8 || i == 10)
			*p++ = '-';
		*p++ = hex[uuid->data[i] >> 4];
		*p++ = hex[uuid->data[i] & 0x0F];
	}
	*p = '\0';
	return buf;
}

/* TimestampTz counts microseconds from 2000-01-01; Kafka wants Unix ms */
static int64
timestamptz_to_unix_ms(TimestampTz ts)
{
	return ts / 1000 +
		(int64) (POSTGRES_EPOCH_JDATE - UNIX_EPOCH_JDATE) * SECS_PER_DAY * 1000;
}
