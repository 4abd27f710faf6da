/*-------------------------------------------------------------------------
 *
 * inbox_attempts.c
 *	  Records that may crash the inbox worker: applied one at a time after
 *	  a crash, and dead-lettered after outbox.inbox_max_attempts crashes,
 *	  so that a handler that kills its process (a bug in C code, the OOM
 *	  killer) costs a bounded number of restarts instead of a crash loop.
 *
 * A handler's ERROR rolls a batch back and the worker goes on (inbox_apply.c);
 * a crash ends the process, with the batch's transaction, and the next
 * worker would run the same batch again and crash again.  So:
 *	- Before each run of a batch the worker writes which records it is
 *	  about to apply (per subscription and partition, the first and last
 *	  offset) to a small file in the data directory, and empties it once
 *	  the batch is settled.  The write costs a few microseconds (no fsync:
 *	  it only has to survive the process, not the machine).
 *	- A worker that starts and finds the file not empty knows its
 *	  predecessor ended inside those records.  It applies each of them in a
 *	  transaction of its own, after committing an attempt mark on the
 *	  partition's offsets row (attempt_offset, attempts).  The apply
 *	  transaction clears the mark with the offset (inbox_offsets.c).
 *	- A record whose mark shows it was being applied when the worker ended
 *	  outbox.inbox_max_attempts times (the first, optimistic run included)
 *	  becomes a dead letter without another call.
 * Only the records of the batch a worker ended in pay for this; every
 * other batch runs as one transaction.  Any end of the process counts as
 * a crash here (a kill -9 of the server too): the worst case is a record
 * applied alone, or, after as many ends inside that same record as
 * outbox.inbox_max_attempts, a dead letter that outbox.inbox_retry()
 * brings back.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "inbox/inbox.h"

#include <fcntl.h>
#include <unistd.h>

#include "access/xact.h"
#include "catalog/pg_type.h"
#include "common/file_perm.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "lib/stringinfo.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"

/* records of one partition the previous worker may have ended in */
typedef struct CarefulRange
{
	char		subscription[NAMEDATALEN];
	char		topic[OUTBOX_TOPIC_MAX_LEN + 1];
	int32		partition;
	int64		first;
	int64		last;
} CarefulRange;

static List *careful = NIL;
static char path[MAXPGPATH];

/*
 * inbox_attempts_begin
 *		At the worker's start: read what the previous worker of database
 *		dboid was applying when it ended (and remove the file).
 */
void
inbox_attempts_begin(Oid dboid)
{
	FILE	   *f;
	char		line[1024];
	MemoryContext old;

	snprintf(path, sizeof(path), "%s/outbox_inbox_%u.inflight", DataDir, dboid);
	f = fopen(path, "r");
	if (f == NULL)
		return;
	old = MemoryContextSwitchTo(TopMemoryContext);
	while (fgets(line, sizeof(line), f) != NULL)
	{
		CarefulRange *r = palloc0(sizeof(CarefulRange));
		char	   *fields[5];
		char	   *save = NULL;
		int			n = 0;
		char	   *tok;

		for (tok = strtok_r(line, "\t\n", &save); tok != NULL && n < 5;
			 tok = strtok_r(NULL, "\t\n", &save))
			fields[n++] = tok;
		if (n != 5)
		{
			pfree(r);
			continue;
		}
		strlcpy(r->subscription, fields[0], sizeof(r->subscription));
		strlcpy(r->topic, fields[1], sizeof(r->topic));
		r->partition = (int32) strtol(fields[2], NULL, 10);
		r->first = strtoll(fields[3], NULL, 10);
		r->last = strtoll(fields[4], NULL, 10);
		careful = lappend(careful, r);
	}
	MemoryContextSwitchTo(old);
	fclose(f);
	if (careful != NIL)
		ereport(LOG,
				(errmsg("outbox inbox: the previous worker of this database ended while it applied records of %d partition(s); they are applied one at a time",
						list_length(careful))));
}

/*
 * inbox_attempts_careful
 *		Must the record at offset of sub's partition part be applied alone,
 *		with an attempt mark?
 */
bool
inbox_attempts_careful(InboxSubscription *sub, InboxPartition *part,
					   int64 offset)
{
	ListCell   *lc;

	foreach(lc, careful)
	{
		CarefulRange *r = lfirst(lc);

		if (r->partition == part->partition && offset >= r->first &&
			offset <= r->last && strcmp(r->subscription, sub->name) == 0 &&
			strcmp(r->topic, part->topic) == 0)
			return true;
	}
	return false;
}

/*
 * inbox_attempts_note_run
 *		Write down, before a run of msgs[0..n-1] of sub, which records it is
 *		about to apply (see the file header).  A failure to write is logged
 *		and otherwise ignored: the file only bounds crash loops.
 */
void
inbox_attempts_note_run(InboxSubscription *sub, rd_kafka_message_t **msgs, int n)
{
	StringInfoData buf;
	int			fd;
	int			i;
	int			j;

	if (path[0] == '\0')
		return;
	initStringInfo(&buf);
	for (i = 0; i < n; i++)
	{
		int64		first = msgs[i]->offset;
		int64		last = msgs[i]->offset;
		bool		seen = false;

		for (j = 0; j < i && !seen; j++)
			seen = msgs[j]->partition == msgs[i]->partition && msgs[j]->rkt == msgs[i]->rkt;
		if (seen)
			continue;
		for (j = i + 1; j < n; j++)
			if (msgs[j]->partition == msgs[i]->partition && msgs[j]->rkt == msgs[i]->rkt)
			{
				first = Min(first, msgs[j]->offset);
				last = Max(last, msgs[j]->offset);
			}
		appendStringInfo(&buf, "%s\t%s\t%d\t%lld\t%lld\n", sub->name,
						 rd_kafka_topic_name(msgs[i]->rkt), msgs[i]->partition,
						 (long long) first, (long long) last);
	}
	fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | PG_BINARY, pg_file_create_mode);
	if (fd < 0 || write(fd, buf.data, buf.len) != buf.len)
		ereport(LOG,
				(errcode_for_file_access(),
				 errmsg("outbox inbox: could not write \"%s\": %m", path)));
	if (fd >= 0)
		close(fd);
	pfree(buf.data);
}

/*
 * inbox_attempts_end_batch
 *		The batch is settled: nothing is in flight.  Records of sub's
 *		partitions whose next_offset passed a careful range need no care any
 *		more.
 */
void
inbox_attempts_end_batch(InboxSubscription *sub)
{
	ListCell   *lc;
	int			fd;

	if (path[0] != '\0' && (fd = open(path, O_WRONLY | O_TRUNC | PG_BINARY, 0)) >= 0)
		close(fd);
	foreach(lc, careful)
	{
		CarefulRange *r = lfirst(lc);
		int			i;

		if (strcmp(r->subscription, sub->name) != 0)
			continue;
		for (i = 0; i < sub->npartitions; i++)
			if (sub->partitions[i].partition == r->partition &&
				strcmp(sub->partitions[i].topic, r->topic) == 0 &&
				sub->partitions[i].next_offset > r->last)
			{
				careful = foreach_delete_current(careful, lc);
				pfree(r);
				break;
			}
	}
}

/*
 * inbox_attempts_mark
 *		Commit, in a transaction of its own, that the worker starts to apply
 *		the record at offset of sub's partition part; returns how many
 *		workers ended inside it so far (the one that made it careful
 *		included).  Raises ERROR when the offset moved meanwhile.
 */
int
inbox_attempts_mark(InboxSubscription *sub, InboxPartition *part, int64 offset)
{
	Datum		values[5];
	int			ret;
	bool		isnull;
	int			ends;

	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	values[0] = CStringGetTextDatum(sub->name);
	values[1] = CStringGetTextDatum(part->topic);
	values[2] = Int32GetDatum(part->partition);
	values[3] = Int64GetDatum(part->next_offset);
	values[4] = Int64GetDatum(offset);
	ret = SPI_execute_with_args("UPDATE outbox.inbox_offsets AS o"
								"   SET attempts = CASE WHEN o.attempt_offset = $5 THEN o.attempts + 1 ELSE 1 END,"
								"       attempt_offset = $5"
								" WHERE o.subscription = $1 AND o.topic = $2 AND o.kafka_partition = $3"
								"   AND o.next_offset = $4"
								" RETURNING o.attempts",
								5, (Oid[]) {TEXTOID, TEXTOID, INT4OID, INT8OID, INT8OID},
								values, NULL, false, 0);
	if (ret != SPI_OK_UPDATE_RETURNING)
		elog(ERROR, "outbox inbox: marking an attempt failed: %s", SPI_result_code_string(ret));
	if (SPI_processed != 1)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("the offset of subscription \"%s\", topic \"%s\", partition %d moved",
						sub->name, part->topic, part->partition)));
	/* this start's mark; each earlier one ended in a crash, as did the batch */
	ends = DatumGetInt32(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
	SPI_finish();
	PopActiveSnapshot();
	CommitTransactionCommand();
	return ends;
}
