/*-------------------------------------------------------------------------
 *
 * inbox_assign.c
 *	  Hand an inbox worker's consumer the partitions of its slice, each at
 *	  the offset the table says.
 *
 * The worker asks for this after anything that may have moved where a
 * partition must be read from: a reload, a rolled-back batch, a seek, new
 * partitions.  Most of those change no partition, only positions, so the
 * consumer is repositioned with rd_kafka_seek_partitions() and keeps its
 * assignment.  rd_kafka_assign() runs only when the set of partitions
 * changes, and never removes partitions twice within ASSIGN_GAP_MS:
 * librdkafka (2.0.2, and up to 2.15: its issue 5573) can send a partition
 * a second fetch stop when assignments replace each other before the first
 * stop is answered, and then aborts the whole server process on the second
 * answer (rd_kafka_assignment_partition_stopped: assert rktp_started).
 * Reloads in a row once did that.  While an assignment waits, the worker
 * polls nothing, so no record is read from a position the table no longer
 * has.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "inbox/inbox.h"
#include "inbox/inbox_consumer_int.h"

#include "utils/timestamp.h"

/* the least time between two rd_kafka_assign() calls that remove partitions */
#define ASSIGN_GAP_MS			1500

/* how long a seek may wait for librdkafka's fetcher to take it */
#define SEEK_TIMEOUT_MS			2000

static rd_kafka_topic_partition_list_t *wanted(InboxSubscription *sub);
static bool same_partitions(rd_kafka_topic_partition_list_t *a,
							rd_kafka_topic_partition_list_t *b);
static void reposition(InboxSubscription *sub, rd_kafka_topic_partition_list_t *want);
static bool seek_all(InboxConsumer *c, rd_kafka_topic_partition_list_t *moves);
static void assign(InboxSubscription *sub, rd_kafka_topic_partition_list_t *want,
				   bool removes);
static void mark_running(InboxSubscription *sub);

/*
 * inbox_consumer_assign
 *		Have sub's consumer fetch every partition of sub in the calling
 *		worker's slice that is neither stalled nor waiting for a seek (none
 *		while sub does not consume: paused, refused, handler missing), each
 *		from its next_offset in the table (-2: the first offset, -1: the
 *		end).  Records fetched before from another position are dropped.
 *		Clears sub->reassign when done; leaves it set when the partitions
 *		changed too soon after the last assignment (see the file's head):
 *		the caller must then poll nothing and call again.  ERROR when
 *		librdkafka refuses the assignment.
 */
void
inbox_consumer_assign(InboxSubscription *sub)
{
	InboxConsumer *c = sub->consumer;
	rd_kafka_topic_partition_list_t *want;
	rd_kafka_topic_partition_list_t *have = NULL;

	if (c == NULL)
		return;
	want = wanted(sub);
	if (rd_kafka_assignment(c->rk, &have) != RD_KAFKA_RESP_ERR_NO_ERROR)
		have = NULL;
	if (c->given != NULL && have != NULL && same_partitions(want, have))
		reposition(sub, want);
	else
		assign(sub, want, have == NULL || have->cnt > 0);
	if (have != NULL)
		rd_kafka_topic_partition_list_destroy(have);
	rd_kafka_topic_partition_list_destroy(want);
}

/* the partitions to fetch and their offsets, sorted */
static rd_kafka_topic_partition_list_t *
wanted(InboxSubscription *sub)
{
	rd_kafka_topic_partition_list_t *list;
	int			i;

	list = rd_kafka_topic_partition_list_new(Max(sub->npartitions, 1));
	for (i = 0; i < sub->npartitions; i++)
	{
		InboxPartition *p = &sub->partitions[i];
		rd_kafka_topic_partition_t *tp;

		if (p->stalled || p->seek_pending || !p->mine ||
			!inbox_subscription_active(sub))
			continue;
		tp = rd_kafka_topic_partition_list_add(list, p->topic, p->partition);
		tp->offset = p->next_offset == -2 ? RD_KAFKA_OFFSET_BEGINNING :
			p->next_offset == -1 ? RD_KAFKA_OFFSET_END : p->next_offset;
	}
	rd_kafka_topic_partition_list_sort(list, NULL, NULL);
	return list;
}

/* do a and b (a sorted) name the same partitions? */
static bool
same_partitions(rd_kafka_topic_partition_list_t *a,
				rd_kafka_topic_partition_list_t *b)
{
	int			i;

	if (a->cnt != b->cnt)
		return false;
	rd_kafka_topic_partition_list_sort(b, NULL, NULL);
	for (i = 0; i < a->cnt; i++)
		if (a->elems[i].partition != b->elems[i].partition ||
			strcmp(a->elems[i].topic, b->elems[i].topic) != 0)
			return false;
	return true;
}

/*
 * The partitions are assigned already: seek those whose consumer is
 * elsewhere (when a seek fails, assign them all again).  Where the consumer is: past the last record it returned
 * (rd_kafka_position), or, when it returned none since, where it was last
 * sent.  A seek bumps the partition's version at once, in this thread, so
 * that no record fetched before it is returned after it.
 */
static void
reposition(InboxSubscription *sub, rd_kafka_topic_partition_list_t *want)
{
	InboxConsumer *c = sub->consumer;
	rd_kafka_topic_partition_list_t *at = rd_kafka_topic_partition_list_copy(want);
	rd_kafka_topic_partition_list_t *moves = rd_kafka_topic_partition_list_new(Max(want->cnt, 1));
	int			i;

	(void) rd_kafka_position(c->rk, at);
	for (i = 0; i < want->cnt; i++)
	{
		rd_kafka_topic_partition_t *w = &want->elems[i];
		rd_kafka_topic_partition_t *g = rd_kafka_topic_partition_list_find(c->given, w->topic,
																		   w->partition);
		int64		now = at->elems[i].offset >= 0 ? at->elems[i].offset :
			g != NULL ? g->offset : RD_KAFKA_OFFSET_INVALID;

		if (now != w->offset)
			rd_kafka_topic_partition_list_add(moves, w->topic, w->partition)->offset = w->offset;
	}
	if (moves->cnt > 0 && !seek_all(c, moves))
	{
		/* not moved: assign them all again (the records fetched are dropped) */
		rd_kafka_topic_partition_list_destroy(moves);
		rd_kafka_topic_partition_list_destroy(at);
		assign(sub, want, true);
		return;
	}
	rd_kafka_topic_partition_list_destroy(moves);
	rd_kafka_topic_partition_list_destroy(at);
	rd_kafka_topic_partition_list_destroy(c->given);
	c->given = rd_kafka_topic_partition_list_copy(want);
	mark_running(sub);
	sub->reassign = false;
}

/*
 * Seek moves, waiting for librdkafka to take each seek: an asynchronous one
 * that the fetcher refuses (a partition not started) would be lost without
 * a word.  False when one failed or the wait ran out.
 */
static bool
seek_all(InboxConsumer *c, rd_kafka_topic_partition_list_t *moves)
{
	rd_kafka_error_t *error = rd_kafka_seek_partitions(c->rk, moves, SEEK_TIMEOUT_MS);
	int			i;

	if (error != NULL)
	{
		elog(DEBUG1, "outbox inbox: seek failed: %s", rd_kafka_error_string(error));
		rd_kafka_error_destroy(error);
		return false;
	}
	for (i = 0; i < moves->cnt; i++)
		if (moves->elems[i].err != RD_KAFKA_RESP_ERR_NO_ERROR)
			return false;
	return true;
}

/*
 * The set of partitions changed: assign want.  An assignment that removes
 * partitions (removes: something is assigned now) waits until the last one
 * that removed some is ASSIGN_GAP_MS old (then sub->reassign stays set and
 * nothing is assigned); one that only adds never waits, since librdkafka
 * starts no partition before the stops it waits for are answered.
 */
static void
assign(InboxSubscription *sub, rd_kafka_topic_partition_list_t *want,
	   bool removes)
{
	InboxConsumer *c = sub->consumer;
	TimestampTz now = GetCurrentTimestamp();
	rd_kafka_resp_err_t err;

	if (removes && c->last_removal != 0 &&
		!TimestampDifferenceExceeds(c->last_removal, now, ASSIGN_GAP_MS))
		return;
	if (c->given != NULL)
		rd_kafka_topic_partition_list_destroy(c->given);
	c->given = NULL;
	if (removes)
		c->last_removal = now;
	err = rd_kafka_assign(c->rk, want->cnt > 0 ? want : NULL);
	if (err != RD_KAFKA_RESP_ERR_NO_ERROR)
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("could not assign the partitions of subscription \"%s\": %s",
						sub->name, rd_kafka_err2str(err))));
	c->given = rd_kafka_topic_partition_list_copy(want);
	mark_running(sub);
	sub->reassign = false;
}

/* the partitions fetched now show running */
static void
mark_running(InboxSubscription *sub)
{
	int			i;

	for (i = 0; i < sub->npartitions; i++)
	{
		InboxPartition *p = &sub->partitions[i];

		if (!p->stalled && !p->seek_pending && p->mine &&
			inbox_subscription_active(sub))
			inbox_status_set(p->status, INBOX_STATE_RUNNING, NULL);
	}
}
