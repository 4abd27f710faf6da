/*-------------------------------------------------------------------------
 *
 * progress_record.c
 *	  The progress records of outbox.delivery = exactly_once: what a batch's
 *	  Kafka transaction says about the database's progress (JSON text in the
 *	  progress topic, under the relay's transactional.id).
 *
 * A snapshot batch's record holds relay_progress before the batch and after
 * it, and the events it hands to row tracking; a batch of row-tracked events
 * lists their ids with the ctids of the row versions claimed.  Every record
 * names its database and its outbox.events (by OID: after DROP and CREATE
 * EXTENSION ids start over).  exactly_once.c reads them back.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "exactly_once/exactly_once.h"
#include "relay/message.h"
#include "relay/snapshot.h"

#include "commands/dbcommands.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "utils/json.h"
#include "utils/timestamp.h"

static void append_state(StringInfo buf, const char *snapshot, int64 floor,
						 bool in_batch, const char *batch_snapshot,
						 int64 batch_floor, int64 last_id);
static void append_header(StringInfo buf, const char *kind, Oid events_relid);

/*
 * outbox_eos_snapshot_record
 *		The progress record of the snapshot batch (snapshot.c) of batch:
 *		relay_progress as sb found it ("before") and as
 *		outbox_snapshot_save() will leave it ("after"), and the events held
 *		back, which go to row tracking with it ("demote").  JSON text,
 *		palloc'd.
 */
char *
outbox_eos_snapshot_record(const OutboxSnapshotBatch *sb, const Batch *batch)
{
	StringInfoData buf;
	bool		first = true;

	initStringInfo(&buf);
	append_header(&buf, "snapshot", batch->events_relid);
	appendStringInfo(&buf, ", \"events\": %d, \"demote\": [", batch->n);
	for (int i = 0; i < batch->n; i++)
	{
		if (!batch->entries[i].held_back)
			continue;
		appendStringInfo(&buf, "%s" INT64_FORMAT, first ? "" : ", ",
						 batch->entries[i].id);
		first = false;
	}
	appendStringInfoString(&buf, "], \"before\": ");
	append_state(&buf, sb->prev, sb->prev_floor, sb->continued, sb->cur,
				 sb->cur_floor, sb->first_from);
	appendStringInfoString(&buf, ", \"after\": ");
	if (sb->exhausted)
		append_state(&buf, sb->cur, sb->cur_floor, false, NULL, 0, 0);
	else
		append_state(&buf, sb->prev, sb->prev_floor, true, sb->cur,
					 sb->cur_floor, sb->from);
	appendStringInfoChar(&buf, '}');
	return buf.data;
}

/*
 * outbox_eos_rows_record
 *		The progress record of a batch of row-tracked events: their ids and
 *		the ctids of the row versions claimed.
 */
char *
outbox_eos_rows_record(const Batch *batch)
{
	const BatchEntry *entries = batch->entries;
	StringInfoData buf;
	bool		first = true;

	initStringInfo(&buf);
	append_header(&buf, "rows", batch->events_relid);
	appendStringInfo(&buf, ", \"events\": %d, \"rows\": [", batch->n);
	for (int i = 0; i < batch->n; i++)
	{
		if (!entries[i].produced)
			continue;			/* held back: not in the transaction */
		appendStringInfo(&buf, "%s[" INT64_FORMAT ", \"(%u,%u)\"]", first ? "" : ", ",
						 entries[i].id,
						 ItemPointerGetBlockNumberNoCheck(&entries[i].ctid),
						 ItemPointerGetOffsetNumberNoCheck(&entries[i].ctid));
		first = false;
	}
	appendStringInfoString(&buf, "]}");
	return buf.data;
}

static void
append_header(StringInfo buf, const char *kind, Oid events_relid)
{
	char	   *datname = get_database_name(MyDatabaseId);

	appendStringInfo(buf, "{\"kind\": \"%s\", \"database\": ", kind);
	escape_json(buf, datname ? datname : "");
	appendStringInfo(buf, ", \"written_at\": \"%s\"",
					 timestamptz_to_str(GetCurrentTimestamp()));
	/* which outbox.events the record speaks of (see record_for_table) */
	appendStringInfo(buf, ", \"events_table\": %u", events_relid);
}

/* [snapshot, id_floor, batch_snapshot, batch_id_floor, batch_last_id] */
static void
append_state(StringInfo buf, const char *snapshot, int64 floor, bool in_batch,
			 const char *batch_snapshot, int64 batch_floor, int64 last_id)
{
	appendStringInfo(buf, "[\"%s\", " INT64_FORMAT ", ", snapshot, floor);
	if (in_batch)
		appendStringInfo(buf, "\"%s\", " INT64_FORMAT ", " INT64_FORMAT "]",
						 batch_snapshot, batch_floor, last_id);
	else
		appendStringInfoString(buf, "null, null, null]");
}
