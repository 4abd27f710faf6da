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
 * uuid's bytes.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "row_message.h"
#include "topic.h"

#include "access/htup_details.h"
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

static void build_headers(const OutboxRow *row, const char *aggregate_type,
						  OutboxHeaderSpace *space, OutboxMessage *msg);
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
 *		is the key, the payload's JSON text the value (NULL: a tombstone),
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

	if (ROW_ISNULL(row, COL_PAYLOAD))
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

/*
 * Set msg's headers: our headers first, then the user's, in their jsonb
 * (sorted) order.  User headers whose value is not a string are left out.
 */
static void
build_headers(const OutboxRow *row, const char *aggregate_type,
			  OutboxHeaderSpace *space, OutboxMessage *msg)
{
	const char **hnames = space->names;
	const char **hvalues = space->values;
	size_t	   *hlens = space->lens;
	int			nheaders = 0;
	bool		isnull = ROW_ISNULL(row, COL_HEADERS);
	char	   *event_type;
	char	   *event_id;
	Datum		d = ROW_VALUE(row, COL_HEADERS);

	event_type = outbox_row_text(row, COL_EVENT_TYPE);
	event_id = uuid_column(row, COL_EVENT_ID, space->event_id);

	if (!isnull)
	{
		Jsonb	   *headers = DatumGetJsonbP(d);
		int			count = JB_ROOT_IS_OBJECT(headers) ? JB_ROOT_COUNT(headers) : 0;

		if (count > 64)
		{
			hnames = palloc(sizeof(char *) * (count + 3));
			hvalues = palloc(sizeof(char *) * (count + 3));
			hlens = palloc(sizeof(size_t) * (count + 3));
		}
	}
	hnames[nheaders] = OUTBOX_HEADER_ID;
	hvalues[nheaders] = event_id;
	hlens[nheaders++] = strlen(event_id);
	hnames[nheaders] = OUTBOX_HEADER_EVENT_TYPE;
	hvalues[nheaders] = event_type;
	hlens[nheaders++] = strlen(event_type);
	hnames[nheaders] = OUTBOX_HEADER_AGGREGATE_TYPE;
	hvalues[nheaders] = aggregate_type;
	hlens[nheaders++] = strlen(aggregate_type);
	if (!isnull)
	{
		Jsonb	   *headers = DatumGetJsonbP(d);
		JsonbIterator *it = JsonbIteratorInit(&headers->root);
		JsonbValue	v;
		JsonbIteratorToken tok;
		char	   *key = NULL;

		while ((tok = JsonbIteratorNext(&it, &v, true)) != WJB_DONE)
		{
			if (tok == WJB_KEY)
				key = pnstrdup(v.val.string.val, v.val.string.len);
			else if (tok == WJB_VALUE && v.type == jbvString && key != NULL)
			{
				hnames[nheaders] = key;
				hvalues[nheaders] = v.val.string.val;
				hlens[nheaders++] = v.val.string.len;
			}
		}
	}
	msg->nheaders = nheaders;
	msg->header_names = hnames;
	msg->header_values = hvalues;
	msg->header_lens = hlens;
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
