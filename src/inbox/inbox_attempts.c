/*-------------------------------------------------------------------------
 *
 * inbox_attempts.c
 *	  Records that may crash the inbox worker: applied alone after a crash,
 *	  and dead-lettered after outbox.inbox_max_attempts crashes, so that a
 *	  handler that kills its process (a bug in C code, the OOM killer) costs
 *	  a bounded number of restarts instead of a crash loop.
 *
 * A handler's ERROR rolls a batch back and the worker goes on (inbox_apply.c);
 * a crash ends the process, with the batch's transaction, and the next
 * worker would run the same batch again and crash again.  So:
 *	- Before each handler call the worker writes which record it is about
 *	  to apply (subscription, topic, partition, offset) over the first line
 *	  of a small file of its own in the data directory (one per database,
 *	  subscription and slice: the workers of a database never write over
 *	  each other's), and marks the line done when the call returns.  Two
 *	  writes of a few bytes, no fsync: the file only has to outlive the
 *	  process, not the machine.
 *	- A worker that starts reads the files of every slice of its
 *	  subscription (the split may have changed since) and keeps the records
 *	  of its own partitions found there: its predecessors ended inside those
 *	  handler calls.  It applies each such record alone, after
 *	  committing an attempt mark on the partition's offsets row
 *	  (attempt_offset, attempts); the apply transaction clears the mark
 *	  with the offset (inbox_offsets.c).
 *	  A batch handler's call writes the range of its first event's
 *	  partition: each record of it is then applied alone.
 *	- A record whose mark shows that workers ended inside it
 *	  outbox.inbox_max_attempts times (the first, unmarked, included)
 *	  becomes a dead letter without another call.
 * Only the record a worker ended in pays for this; batches run as one
 * transaction.  Any end of the process inside a handler call counts (a
 * kill -9 of the server too), except one that SIGTERM asked for (a fast
 * shutdown, pg_terminate_backend()): the worst case is one record applied
 * alone, or, after as many ends inside that same record as
 * outbox.inbox_max_attempts, a dead letter that outbox.inbox_retry() brings
 * back.  Queue mode calls no handler and writes nothing here.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "inbox/inbox.h"

#include <fcntl.h>
#include <unistd.h>

#include "access/xact.h"
#include "catalog/pg_type.h"
#include "common/hashfn.h"
#include "common/file_perm.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "storage/ipc.h"
#include "tcop/tcopprot.h"
#include "utils/builtins.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"

/* the records earlier workers ended in, inside a handler call */
typedef struct Careful
{
	bool		active;
	char		topic[OUTBOX_TOPIC_MAX_LEN + 1];
	int32		partition;
	int64		offset;
	int64		last;			/* a batch handler's call: up to this offset */
} Careful;

static Careful careful[OUTBOX_INBOX_MAX_WORKERS_PER_SUBSCRIPTION];
static int	ncareful = 0;
static char careful_subscription[NAMEDATALEN];

static int	file = -1;
static char path[MAXPGPATH];

/* SIGTERM came: a stop someone asked for (a fast shutdown, pg_terminate_backend) */
static volatile sig_atomic_t stop_requested = false;

static void forget_call_at_stop(int code, Datum arg);

/* the file of slice of subscription in database dboid, into buf */
static void
file_path(char *buf, size_t len, Oid dboid, const char *subscription, int slice)
{
	snprintf(buf, len, "%s/outbox_inbox_%u_%08x_%d.inflight", DataDir, dboid,
			 hash_bytes((const unsigned char *) subscription, strlen(subscription)),
			 slice);
}

/* keep the record of line if it is one of sub's own partitions in flight */
static void
read_line(InboxSubscription *sub, char *line)
{
	char	   *fields[5];
	char	   *save = NULL;
	char	   *tok;
	int			n = 0;
	Careful    *c;

	if (line[0] == '#' || line[0] == '\0' || ncareful >= (int) lengthof(careful))
		return;
	for (tok = strtok_r(line, "\t\n", &save); tok != NULL && n < 5;
		 tok = strtok_r(NULL, "\t\n", &save))
		fields[n++] = tok;
	if (n < 4 || strcmp(fields[0], sub->name) != 0)
		return;
	c = &careful[ncareful];
	strlcpy(c->topic, fields[1], sizeof(c->topic));
	c->partition = (int32) strtol(fields[2], NULL, 10);
	c->offset = strtoll(fields[3], NULL, 10);
	c->last = n == 5 ? strtoll(fields[4], NULL, 10) : c->offset;
	if (inbox_partition_slice(c->topic, c->partition, sub->nslices) != sub->slice)
		return;
	c->active = true;
	ncareful++;
	if (c->last == c->offset)
		ereport(LOG,
				(errmsg("outbox inbox: a previous worker ended in the handler of subscription \"%s\" at topic \"%s\", partition %d, offset %lld; that record is applied alone",
						sub->name, c->topic, c->partition, (long long) c->offset)));
	else
		ereport(LOG,
				(errmsg("outbox inbox: a previous worker ended in the batch handler of subscription \"%s\" at topic \"%s\", partition %d, offsets %lld to %lld; each of those records is applied alone",
						sub->name, c->topic, c->partition, (long long) c->offset,
						(long long) c->last)));
}

/*
 * inbox_attempts_begin
 *		At the worker's start (sub loaded, its slice known): read the
 *		records earlier workers of sub were in a handler call for when they
 *		ended, and open this worker's file for its calls.  A file that
 *		cannot be opened is logged; the worker then runs without this guard.
 */
void
inbox_attempts_begin(InboxSubscription *sub)
{
	int			slice;

	strlcpy(careful_subscription, sub->name, sizeof(careful_subscription));
	ncareful = 0;
	for (slice = 0; slice < OUTBOX_INBOX_MAX_WORKERS_PER_SUBSCRIPTION; slice++)
	{
		char		other[MAXPGPATH];
		char		line[1024] = "";
		FILE	   *f;

		file_path(other, sizeof(other), MyDatabaseId, sub->name, slice);
		f = fopen(other, "r");
		if (f == NULL)
			continue;
		if (fgets(line, sizeof(line), f) != NULL)
			read_line(sub, line);
		fclose(f);
	}
	file_path(path, sizeof(path), MyDatabaseId, sub->name, sub->slice);
	file = open(path, O_RDWR | O_CREAT | PG_BINARY, pg_file_create_mode);
	if (file < 0)
		ereport(LOG,
				(errcode_for_file_access(),
				 errmsg("outbox inbox: could not open \"%s\": %m", path)));
	else
		inbox_attempts_called();
	before_shmem_exit(forget_call_at_stop, (Datum) 0);
}

/*
 * inbox_attempts_sigterm
 *		The worker's SIGTERM handler: die(), having noted that the end to
 *		come was asked for.  A fast shutdown or a restart in the middle of
 *		a long handler call is not a crash inside it: counted as one, a few
 *		deploys made a healthy record a dead letter (a fresh user's try).
 */
void
inbox_attempts_sigterm(SIGNAL_ARGS)
{
	stop_requested = true;
	die(postgres_signal_arg);
}

/*
 * At exit after a SIGTERM (the FATAL it raises runs the exit callbacks; a
 * crash, kill -9 or SIGQUIT runs none): the call in progress, if any, did
 * not end the process, so mark the line done.
 */
static void
forget_call_at_stop(int code, Datum arg)
{
	if (stop_requested)
		inbox_attempts_called();
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
	int			i;

	if (strcmp(sub->name, careful_subscription) != 0)
		return false;
	for (i = 0; i < ncareful; i++)
		if (careful[i].active && careful[i].offset <= offset && offset <= careful[i].last &&
			careful[i].partition == part->partition &&
			strcmp(careful[i].topic, part->topic) == 0)
			return true;
	return false;
}

/*
 * inbox_attempts_calling
 *		Write down that the handler of subscription is called for ev now,
 *		and, for a batch handler, for the records of ev's partition up to
 *		last_offset (see the file header).  A failed write is ignored: the
 *		file only bounds crash loops.
 */
void
inbox_attempts_calling(const char *subscription, const InboxEvent *ev,
					   int64 last_offset)
{
	char		line[NAMEDATALEN + OUTBOX_TOPIC_MAX_LEN + 64];
	int			len;

	if (file < 0)
		return;
	len = snprintf(line, sizeof(line), "%s\t%s\t%d\t%lld\t%lld\n", subscription, ev->topic,
				   ev->partition, (long long) ev->offset, (long long) last_offset);
	if (pwrite(file, line, Min(len, (int) sizeof(line) - 1), 0) < 0)
		return;
}

/*
 * inbox_attempts_called
 *		The handler call returned (or raised an error the worker caught):
 *		mark the line done.
 */
void
inbox_attempts_called(void)
{
	if (file >= 0 && pwrite(file, "#", 1, 0) < 0)
		return;
}

/*
 * inbox_attempts_end_batch
 *		A batch of sub is settled: once sub's partition passed the record the
 *		previous worker ended in, it needs no care any more.
 */
void
inbox_attempts_end_batch(InboxSubscription *sub)
{
	int			i;
	int			c;

	if (strcmp(sub->name, careful_subscription) != 0)
		return;
	for (c = 0; c < ncareful; c++)
		for (i = 0; i < sub->npartitions; i++)
			if (careful[c].active &&
				sub->partitions[i].partition == careful[c].partition &&
				strcmp(sub->partitions[i].topic, careful[c].topic) == 0 &&
				sub->partitions[i].next_offset > careful[c].last)
				careful[c].active = false;
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

	SetCurrentStatementStartTimestamp();
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
