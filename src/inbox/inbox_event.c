/*-------------------------------------------------------------------------
 *
 * inbox_event.c
 *	  A Kafka record as the inbox sees it: the fields of
 *	  outbox.inbox_event read from the message, and the composite value a
 *	  handler receives.
 *
 * What a record carries is whatever its producer sent, so nothing here
 * trusts it:
 *	- the value is JSON (payload) only when it is valid JSON in the
 *	  database's encoding; otherwise its bytes go to payload_bytes; a
 *	  tombstone (no value) has neither;
 *	- the key and header values become text when they are valid in the
 *	  database's encoding and hold no NUL byte, otherwise the text is their
 *	  bytes in hex ('\x...');
 *	- event_id is the "id" header (outbox's Debezium format) or "ce_id"
 *	  (CloudEvents binary mode) when it is a uuid; any other id is hashed
 *	  (MD5) into a name-based uuid, so that copies of it still meet in the
 *	  de-duplication; NULL when there is neither header with a value (an
 *	  empty or null id is no id).
 * Runs in the worker's own thread, inside the apply transaction: an error
 * here (out of memory, a JSON number beyond numeric on PostgreSQL 15)
 * makes the record a dead letter like a handler error would.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "inbox/inbox.h"

#include "access/htup_details.h"
#include "catalog/namespace.h"
#include "catalog/pg_type.h"
#include "common/md5.h"
#include "executor/spi.h"
#include "funcapi.h"
#include "mb/pg_wchar.h"
#include "utils/builtins.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/syscache.h"
#include "utils/typcache.h"

/* the fields of outbox.inbox_event, in its order */
#define EV_NATTS	12

static TupleDesc event_desc = NULL;
static Oid	event_type_oid = InvalidOid;

static text *bytes_to_text(const char *data, size_t len);
static bool parse_uuid(const char *s, size_t len, pg_uuid_t *out);
static void hash_uuid(const char *s, size_t len, pg_uuid_t *out);
static Jsonb *headers_to_jsonb(rd_kafka_headers_t *hdrs);
static void read_value(InboxEvent *ev, const char *data, size_t len);

/*
 * inbox_event_type_oid
 *		OID of outbox.inbox_event in the current database, looked up once
 *		per worker (inbox_event_forget() drops it when the extension may
 *		have been re-created).  Call in a transaction.
 */
Oid
inbox_event_type_oid(void)
{
	if (!OidIsValid(event_type_oid))
		event_type_oid = GetSysCacheOid2(TYPENAMENSP, Anum_pg_type_oid,
										 CStringGetDatum("inbox_event"),
										 ObjectIdGetDatum(get_namespace_oid(OUTBOX_SCHEMA, false)));
	if (!OidIsValid(event_type_oid))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("type outbox.inbox_event does not exist"),
				 errhint("ALTER EXTENSION outbox UPDATE to version 1.8 or later.")));
	return event_type_oid;
}

/*
 * inbox_event_forget
 *		Forget the type's OID and descriptor: looked up again at next use.
 */
void
inbox_event_forget(void)
{
	event_type_oid = InvalidOid;
	if (event_desc != NULL)
		FreeTupleDesc(event_desc);
	event_desc = NULL;
}

/*
 * inbox_event_from_message
 *		Fill *ev from a consumed Kafka message msg (no error set); pointers
 *		are palloc'd in the current memory context.
 */
void
inbox_event_from_message(InboxEvent *ev, const rd_kafka_message_t *msg)
{
	rd_kafka_headers_t *hdrs = NULL;
	rd_kafka_timestamp_type_t tstype;
	int64		ts;
	const void *value;
	size_t		size;

	memset(ev, 0, sizeof(*ev));
	ev->topic = pstrdup(rd_kafka_topic_name(msg->rkt));
	ev->partition = msg->partition;
	ev->offset = msg->offset;
	if (msg->key != NULL)
		ev->key = bytes_to_text(msg->key, msg->key_len);

	if (rd_kafka_message_headers(msg, &hdrs) == RD_KAFKA_RESP_ERR_NO_ERROR && hdrs != NULL)
	{
		ev->headers = headers_to_jsonb(hdrs);
		/*
		 * An empty or null id is no id (issue 36 #1): hashed, every such
		 * record had the same event_id and all but the first were dropped as
		 * copies, silently.  Such a header is passed over (an "id" without a
		 * value lets a "ce_id" with one count), and a record with no id that
		 * has a value is covered by its offset alone.
		 */
		if ((rd_kafka_header_get_last(hdrs, OUTBOX_HEADER_ID, &value, &size) == RD_KAFKA_RESP_ERR_NO_ERROR &&
			 value != NULL && size > 0) ||
			(rd_kafka_header_get_last(hdrs, OUTBOX_HEADER_CE_ID, &value, &size) == RD_KAFKA_RESP_ERR_NO_ERROR &&
			 value != NULL && size > 0))
		{
			ev->has_event_id = true;
			if (!parse_uuid(value, size, &ev->event_id))
				hash_uuid(value, size, &ev->event_id);
		}
		if ((rd_kafka_header_get_last(hdrs, OUTBOX_HEADER_EVENT_TYPE, &value, &size) == RD_KAFKA_RESP_ERR_NO_ERROR ||
			 rd_kafka_header_get_last(hdrs, "ce_type", &value, &size) == RD_KAFKA_RESP_ERR_NO_ERROR) &&
			value != NULL)
			ev->event_type = bytes_to_text(value, size);
		if (rd_kafka_header_get_last(hdrs, OUTBOX_HEADER_AGGREGATE_TYPE, &value, &size) == RD_KAFKA_RESP_ERR_NO_ERROR &&
			value != NULL)
			ev->aggregate_type = bytes_to_text(value, size);
	}

	if (msg->payload != NULL)
		read_value(ev, msg->payload, msg->len);

	ts = rd_kafka_message_timestamp(msg, &tstype);
	if (ts >= 0 && tstype != RD_KAFKA_TIMESTAMP_NOT_AVAILABLE)
	{
		ev->has_timestamp = true;
		ev->timestamp = ts * 1000 -
			((int64) (POSTGRES_EPOCH_JDATE - UNIX_EPOCH_JDATE) * USECS_PER_DAY);
	}
}

/*
 * The value: jsonb when it is JSON, its bytes otherwise.
 */
static void
read_value(InboxEvent *ev, const char *data, size_t len)
{
	Datum		jsonb;
	char	   *str;

	if (len < MaxAllocSize && memchr(data, '\0', len) == NULL &&
		pg_verifymbstr(data, (int) len, true))
	{
		str = pnstrdup(data, len);
		if (outbox_jsonb_in_safe(str, len, &jsonb))
		{
			ev->payload = DatumGetJsonbP(jsonb);
			pfree(str);
			return;
		}
		pfree(str);
	}
	ev->payload_bytes = (bytea *) palloc(VARHDRSZ + len);
	SET_VARSIZE(ev->payload_bytes, VARHDRSZ + len);
	memcpy(VARDATA(ev->payload_bytes), data, len);
}

/*
 * Bytes as text: as they are when valid in the database's encoding and
 * free of NUL, else '\x' and their hex digits.
 */
static text *
bytes_to_text(const char *data, size_t len)
{
	static const char hex[] = "0123456789abcdef";
	StringInfoData buf;
	size_t		i;

	if (memchr(data, '\0', len) == NULL && pg_verifymbstr(data, (int) len, true))
		return cstring_to_text_with_len(data, (int) len);
	initStringInfo(&buf);
	appendStringInfoString(&buf, "\\x");
	for (i = 0; i < len; i++)
	{
		appendStringInfoChar(&buf, hex[((unsigned char) data[i]) >> 4]);
		appendStringInfoChar(&buf, hex[((unsigned char) data[i]) & 0xf]);
	}
	return cstring_to_text_with_len(buf.data, buf.len);
}

/* the value of one hex digit, or -1 */
static int
hex_value(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

/*
 * A uuid in its canonical form (8-4-4-4-12 hex digits) or as 32 hex
 * digits, into *out; false for anything else.
 */
static bool
parse_uuid(const char *s, size_t len, pg_uuid_t *out)
{
	int			n = 0;
	size_t		i;

	if (len != 36 && len != 32)
		return false;
	for (i = 0; i < len; i++)
	{
		int			hi,
					lo;

		if (len == 36 && (i == 8 || i == 13 || i == 18 || i == 23))
		{
			if (s[i] != '-')
				return false;
			continue;
		}
		if (i + 1 >= len || n >= UUID_LEN)
			return false;
		hi = hex_value(s[i]);
		lo = hex_value(s[i + 1]);
		if (hi < 0 || lo < 0)
			return false;
		out->data[n++] = (unsigned char) (hi << 4 | lo);
		i++;
	}
	return n == UUID_LEN;
}

/*
 * A name-based uuid (RFC 4122 version 3 layout) from the MD5 of an id that
 * is not a uuid.
 */
static void
hash_uuid(const char *s, size_t len, pg_uuid_t *out)
{
	const char *errstr = NULL;
	uint8		digest[16];

	if (!pg_md5_binary(s, len, digest, &errstr))
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("could not hash an event id: %s", errstr)));
	memcpy(out->data, digest, UUID_LEN);
	out->data[6] = (out->data[6] & 0x0f) | 0x30;
	out->data[8] = (out->data[8] & 0x3f) | 0x80;
}

/*
 * Every header as a JSON object of strings (a header without a value is
 * null); a name that appears twice keeps its last value.
 */
static Jsonb *
headers_to_jsonb(rd_kafka_headers_t *hdrs)
{
	JsonbParseState *state = NULL;
	JsonbValue *result;
	const char *name;
	const void *value;
	size_t		size;
	size_t		i;

	(void) pushJsonbValue(&state, WJB_BEGIN_OBJECT, NULL);
	for (i = 0; rd_kafka_header_get_all(hdrs, i, &name, &value, &size) == RD_KAFKA_RESP_ERR_NO_ERROR; i++)
	{
		JsonbValue	k;
		JsonbValue	v;
		text	   *t;

		t = bytes_to_text(name, strlen(name));
		k.type = jbvString;
		k.val.string.val = VARDATA_ANY(t);
		k.val.string.len = VARSIZE_ANY_EXHDR(t);
		(void) pushJsonbValue(&state, WJB_KEY, &k);
		if (value == NULL)
			v.type = jbvNull;
		else
		{
			t = bytes_to_text(value, size);
			v.type = jbvString;
			v.val.string.val = VARDATA_ANY(t);
			v.val.string.len = VARSIZE_ANY_EXHDR(t);
		}
		(void) pushJsonbValue(&state, WJB_VALUE, &v);
	}
	result = pushJsonbValue(&state, WJB_END_OBJECT, NULL);
	return JsonbValueToJsonb(result);
}

/*
 * inbox_event_datum
 *		The outbox.inbox_event value of ev for subscription, in the current
 *		memory context.  Call in a transaction.
 */
Datum
inbox_event_datum(const InboxEvent *ev, const char *subscription)
{
	Datum		values[EV_NATTS];
	bool		nulls[EV_NATTS];
	HeapTuple	tuple;

	if (event_desc == NULL)
	{
		MemoryContext old = MemoryContextSwitchTo(TopMemoryContext);

		event_desc = lookup_rowtype_tupdesc_copy(inbox_event_type_oid(), -1);
		event_desc = BlessTupleDesc(event_desc);
		MemoryContextSwitchTo(old);
	}
	if (event_desc->natts != EV_NATTS)
		ereport(ERROR,
				(errcode(ERRCODE_DATATYPE_MISMATCH),
				 errmsg("type outbox.inbox_event has %d attributes, this library expects %d",
						event_desc->natts, EV_NATTS)));

	memset(nulls, false, sizeof(nulls));
	values[0] = CStringGetTextDatum(subscription);
	values[1] = CStringGetTextDatum(ev->topic);
	values[2] = Int32GetDatum(ev->partition);
	values[3] = Int64GetDatum(ev->offset);
	values[4] = PointerGetDatum(ev->key);
	nulls[4] = ev->key == NULL;
	values[5] = UUIDPGetDatum(&ev->event_id);
	nulls[5] = !ev->has_event_id;
	values[6] = PointerGetDatum(ev->event_type);
	nulls[6] = ev->event_type == NULL;
	values[7] = PointerGetDatum(ev->aggregate_type);
	nulls[7] = ev->aggregate_type == NULL;
	values[8] = PointerGetDatum(ev->headers);
	nulls[8] = ev->headers == NULL;
	values[9] = PointerGetDatum(ev->payload);
	nulls[9] = ev->payload == NULL;
	values[10] = PointerGetDatum(ev->payload_bytes);
	nulls[10] = ev->payload_bytes == NULL;
	values[11] = TimestampTzGetDatum(ev->timestamp);
	nulls[11] = !ev->has_timestamp;
	tuple = heap_form_tuple(event_desc, values, nulls);
	return HeapTupleGetDatum(tuple);
}

/*
 * inbox_event_values
 *		The twelve fields of ev for subscription, in outbox.inbox_event's
 *		order, as SPI parameters (nulls: 'n' for NULL, ' ' otherwise).
 */
void
inbox_event_values(const InboxEvent *ev, const char *subscription,
				   Datum *values, char *nulls)
{
	memset(nulls, ' ', EV_NATTS);
	values[0] = CStringGetTextDatum(subscription);
	values[1] = CStringGetTextDatum(ev->topic);
	values[2] = Int32GetDatum(ev->partition);
	values[3] = Int64GetDatum(ev->offset);
	values[4] = PointerGetDatum(ev->key);
	if (ev->key == NULL)
		nulls[4] = 'n';
	values[5] = UUIDPGetDatum((pg_uuid_t *) &ev->event_id);
	if (!ev->has_event_id)
		nulls[5] = 'n';
	values[6] = PointerGetDatum(ev->event_type);
	if (ev->event_type == NULL)
		nulls[6] = 'n';
	values[7] = PointerGetDatum(ev->aggregate_type);
	if (ev->aggregate_type == NULL)
		nulls[7] = 'n';
	values[8] = PointerGetDatum(ev->headers);
	if (ev->headers == NULL)
		nulls[8] = 'n';
	values[9] = PointerGetDatum(ev->payload);
	if (ev->payload == NULL)
		nulls[9] = 'n';
	values[10] = PointerGetDatum(ev->payload_bytes);
	if (ev->payload_bytes == NULL)
		nulls[10] = 'n';
	values[11] = TimestampTzGetDatum(ev->timestamp);
	if (!ev->has_timestamp)
		nulls[11] = 'n';
}

/*
 * inbox_event_from_row
 *		Fill *ev from a row of outbox.inbox_dead whose first twelve columns
 *		after id (2..13) are outbox.inbox_event's fields, subscription
 *		first; the values are copied into the current memory context.
 */
void
inbox_event_from_row(InboxEvent *ev, HeapTuple row, TupleDesc desc)
{
	bool		isnull;
	Datum		d;

	memset(ev, 0, sizeof(*ev));
	ev->dead_id = DatumGetInt64(SPI_getbinval(row, desc, 1, &isnull));
	ev->topic = TextDatumGetCString(SPI_getbinval(row, desc, 3, &isnull));
	ev->partition = DatumGetInt32(SPI_getbinval(row, desc, 4, &isnull));
	ev->offset = DatumGetInt64(SPI_getbinval(row, desc, 5, &isnull));
	d = SPI_getbinval(row, desc, 6, &isnull);
	ev->key = isnull ? NULL : DatumGetTextPCopy(d);
	d = SPI_getbinval(row, desc, 7, &isnull);
	ev->has_event_id = !isnull;
	if (!isnull)
		memcpy(&ev->event_id, DatumGetUUIDP(d), sizeof(pg_uuid_t));
	d = SPI_getbinval(row, desc, 8, &isnull);
	ev->event_type = isnull ? NULL : DatumGetTextPCopy(d);
	d = SPI_getbinval(row, desc, 9, &isnull);
	ev->aggregate_type = isnull ? NULL : DatumGetTextPCopy(d);
	d = SPI_getbinval(row, desc, 10, &isnull);
	ev->headers = isnull ? NULL : DatumGetJsonbPCopy(d);
	d = SPI_getbinval(row, desc, 11, &isnull);
	ev->payload = isnull ? NULL : DatumGetJsonbPCopy(d);
	d = SPI_getbinval(row, desc, 12, &isnull);
	ev->payload_bytes = isnull ? NULL : DatumGetByteaPCopy(d);
	d = SPI_getbinval(row, desc, 13, &isnull);
	ev->has_timestamp = !isnull;
	if (!isnull)
		ev->timestamp = DatumGetTimestampTz(d);
}
