/*-------------------------------------------------------------------------
 *
 * inbox_witness.c
 *	  Telling a re-created topic from the one the offsets were stored for.
 *
 * A topic deleted and created again while a subscription consumes it has
 * offsets that start at 0 again.  Where the new topic is shorter than the
 * stored offset, the consumer says so (the partition stalls, see
 * inbox_consumer.c); where it is longer, librdkafka 2.0.2 goes on fetching
 * at the stored offset, in the new topic, without a word (it shows no topic
 * id), and the records before that offset would be skipped.
 *
 * So each partition keeps a witness with its offset: the offset and a
 * fingerprint (timestamp, key, value) of the last record applied, written
 * by the same compare-and-set (inbox_offsets.c).  Before a batch that
 * continues right after the witness commits, a second consumer of the
 * worker, the probe, reads the record at the witness's offset from Kafka
 * as it is now (librdkafka's simple consumer: a fetch from an offset).  It
 * is asked when the batch starts and answered while the handler runs, so
 * it costs one fetch per batch in parallel with the apply.  A different
 * record there means another topic: the batch is rolled back and run
 * again without that partition, which stalls until outbox.inbox_seek()
 * says where to go on, as when Kafka no longer has the offset.  A record
 * Kafka no longer has there (retention, compaction) cannot tell, and the
 * batch goes on.  The probe fetches after the batch's records were
 * fetched, so a topic re-created between the two stalls the partition
 * rather than letting it through: when in doubt, stop.
 *
 * The probe's fetch of a partition is started once and moved by a seek
 * per batch.  Stopped and started again, or paused and resumed, it
 * answered after 1.0 s every second or third batch (librdkafka 2.0.2, 12
 * partitions: 2,541 events/s): a partition whose queue is full stops
 * fetching, a seek puts its version barrier at the head of that queue (so
 * the broker thread's purge of the old records removes nothing), and
 * once the application has popped them no one wakes the broker thread
 * until its 1 s wait ends.  So the queue is emptied before the seek, and
 * a question not answered within PROBE_NUDGE_MS (records fetched between
 * the two) is asked again by a second seek, which wakes the broker
 * thread, with the wait doubled each time so that a slow broker is not
 * interrupted forever.
 *
 * The probe's callbacks are librdkafka's defaults (no palloc, no ereport on
 * its threads); it is polled on the worker's own thread only.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "inbox/inbox.h"

#include "common/hashfn.h"
#include "miscadmin.h"
#include "storage/ipc.h"
#include "storage/pmsignal.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

/* a running fetch's queue of records read ahead (kB, per partition) */
#define PROBE_QUEUE_KB			"64"
/* how long the probe may take to answer, in all (ms) */
#define PROBE_TIMEOUT_MS		10000
/* most partitions of one batch the probe asks about */
#define PROBE_MAX				256
/* re-created partitions remembered across reloads of the worker */
#define RECREATED_MAX			64
/* a fetch of the probe not asked for this long is stopped (ms) */
#define PROBE_IDLE_MS			10000
/* first wait before a question is asked again by a seek (ms, doubled) */
#define PROBE_NUDGE_MS			100
/* most records popped from a fetch's queue before its seek */
#define PROBE_DRAIN_MAX			10000

/* settings of the probe on top of the consumer's */
static const char *const probe_settings[][2] = {
	{"client.id", "outbox-inbox-probe"},
	/*
	 * Per partition for the simple consumer: a running fetch reads this
	 * far ahead of the witness, then waits for the next seek.  Kafka
	 * returns a record larger than the fetch size all the same.
	 */
	{"queued.max.messages.kbytes", PROBE_QUEUE_KB},
	{"fetch.message.max.bytes", "65536"},
	/*
	 * A fetch moved per batch must not wait out a backoff: with librdkafka's defaults (fetch.wait.max.ms 500,
	 * fetch.error.backoff.ms 500), or with queued.min.messages 1 (a second
	 * partition's fetch waits a second behind the first's record), an answer
	 * took 0.5 to 2 s, and a batch as long: 7 events/s at batch size 7.
	 * Measured with these: 2-14 ms for three partitions.
	 */
	{"fetch.wait.max.ms", "10"},
	{"fetch.error.backoff.ms", "10"},
	{NULL, NULL}
};

typedef enum Answer
{
	ANSWER_WAITING,
	ANSWER_SAME,
	ANSWER_OTHER,
	ANSWER_CANNOT_TELL
} Answer;

typedef struct Question
{
	InboxPartition *part;
	int64		offset;
	uint64		hash;
	Answer		answer;
	rd_kafka_topic_t *rkt;		/* the probe's fetch of this partition */
	TimestampTz nudge_at;		/* when to seek again if no answer came */
	int			nudge_ms;		/* the wait after the next seek */
} Question;

static rd_kafka_t *probe = NULL;
static Question questions[PROBE_MAX];
static int	nquestions = 0;

/* the probe's running fetches, one per partition asked about */
typedef struct ProbeFetch
{
	rd_kafka_topic_t *rkt;
	int32		partition;
	TimestampTz asked;			/* when a question last moved it */
} ProbeFetch;

static ProbeFetch fetches[PROBE_MAX];
static int	nfetches = 0;

/*
 * The probe's topic handles, kept while the probe lives: a handle made
 * again per batch made librdkafka look the topic's leader up again before
 * each fetch, about a second per batch.
 */
/* as many as questions: one of them is always free to drop */
#define PROBE_TOPICS			PROBE_MAX
static rd_kafka_topic_t *probe_topics[PROBE_TOPICS];
static int	nprobe_topics = 0;

/* partitions found re-created: (topic, partition, next_offset) */
static struct
{
	char		topic[OUTBOX_TOPIC_MAX_LEN + 1];
	int32		partition;
	int64		next_offset;
} recreated[RECREATED_MAX];
static int	nrecreated = 0;

static bool ensure_probe(InboxSubscription *sub);
static bool fetch_from(rd_kafka_topic_t *rkt, int32 partition, int64 offset,
					   TimestampTz now);
static int	find_fetch(rd_kafka_topic_t *rkt, int32 partition);
static void stop_fetch(int i);
static void stop_fetches(rd_kafka_topic_t *rkt, TimestampTz asked_before);
static void drop_fetch(rd_kafka_topic_t *rkt, int32 partition);
static void take_answer(Question *q, int wait_ms);
static void forget_questions(void);
static rd_kafka_topic_t *probe_topic(const char *name);
static void stall(InboxSubscription *sub, InboxPartition *p, bool first);

/*
 * inbox_witness_hash
 *		The fingerprint of a Kafka record: its timestamp, key and value.
 */
uint64
inbox_witness_hash(const rd_kafka_message_t *m)
{
	int64		ts = rd_kafka_message_timestamp(m, NULL);
	uint64		h = (uint64) ts;

	if (m->key != NULL)
		h = hash_bytes_extended((const unsigned char *) m->key, (int) m->key_len, h);
	h = hash_bytes_extended((const unsigned char *) "\0", 1, h);
	if (m->payload != NULL)
		h = hash_bytes_extended((const unsigned char *) m->payload, (int) m->len, h);
	return h;
}

/*
 * inbox_witness_request
 *		A batch msgs[0..n-1] of sub is about to be applied: ask the probe for
 *		the witness record of each partition whose records go on right
 *		after its witness.  Asks nothing when none does.
 */
void
inbox_witness_request(InboxSubscription *sub, rd_kafka_message_t **msgs, int n)
{
	TimestampTz now;
	int			i;

	/* a run that failed left its questions */
	forget_questions();
	for (i = 0; i < n && nquestions < PROBE_MAX; i++)
	{
		InboxPartition *p = inbox_find_partition(sub, rd_kafka_topic_name(msgs[i]->rkt),
												 msgs[i]->partition);
		int			q;

		if (p == NULL || p->stalled || p->witness_offset < 0 ||
			p->witness_offset != p->next_offset - 1 || msgs[i]->offset != p->next_offset)
			continue;
		for (q = 0; q < nquestions && questions[q].part != p; q++)
			;
		if (q < nquestions)
			continue;
		questions[nquestions].part = p;
		questions[nquestions].offset = p->witness_offset;
		questions[nquestions].hash = p->witness_hash;
		questions[nquestions].answer = ANSWER_WAITING;
		questions[nquestions].rkt = NULL;
		nquestions++;
	}
	if (nquestions == 0 || !ensure_probe(sub))
	{
		nquestions = 0;
		return;
	}
	/*
	 * The simple consumer, a fetch per partition from an offset: no
	 * assignment to change twice per batch (librdkafka 2.0.2 aborts on an
	 * assign undone before its partitions started).  A partition of a
	 * deleted topic stalls and is asked no more: its fetch, which would
	 * retry forever, stops once idle.
	 */
	now = GetCurrentTimestamp();
	stop_fetches(NULL, TimestampTzPlusMilliseconds(now, -PROBE_IDLE_MS));
	for (i = 0; i < nquestions; i++)
	{
		Question   *q = &questions[i];

		q->rkt = probe_topic(q->part->topic);
		if (q->rkt == NULL || !fetch_from(q->rkt, q->part->partition, q->offset, now))
			q->answer = ANSWER_CANNOT_TELL;
		q->nudge_ms = PROBE_NUDGE_MS;
		q->nudge_at = TimestampTzPlusMilliseconds(now, q->nudge_ms);
	}
}

/*
 * Point the probe's fetch of (rkt, partition) at offset: a seek of the
 * running fetch, or a start.  Records fetched before are dropped by
 * librdkafka (a seek bumps the fetch's version), so the first record
 * that comes was fetched after this call.  False if librdkafka refused.
 */
static bool
fetch_from(rd_kafka_topic_t *rkt, int32 partition, int64 offset,
		   TimestampTz now)
{
	int			i = find_fetch(rkt, partition);

	if (i >= 0)
	{
		rd_kafka_message_t *m;
		int			n = 0;

		/*
		 * Empty its queue first, so that the seek finds room to fetch (see
		 * the file's header); it holds PROBE_QUEUE_KB and one fetch at most.
		 */
		while (n++ < PROBE_DRAIN_MAX && (m = rd_kafka_consume(rkt, partition, 0)) != NULL)
			rd_kafka_message_destroy(m);
		fetches[i].asked = now;
		/* timeout 0: asynchronous, the answer is waited for in verify */
		return rd_kafka_seek(rkt, partition, offset, 0) == RD_KAFKA_RESP_ERR_NO_ERROR;
	}
	/* full: every fetch was asked within PROBE_IDLE_MS, stop the oldest */
	if (nfetches == PROBE_MAX)
	{
		int			oldest = 0;

		for (i = 1; i < nfetches; i++)
			if (fetches[i].asked < fetches[oldest].asked)
				oldest = i;
		stop_fetch(oldest);
	}
	if (rd_kafka_consume_start(rkt, partition, offset) != 0)
		return false;
	fetches[nfetches].rkt = rkt;
	fetches[nfetches].partition = partition;
	fetches[nfetches].asked = now;
	nfetches++;
	return true;
}

/* the index in fetches[] of the probe's fetch of (rkt, partition), or -1 */
static int
find_fetch(rd_kafka_topic_t *rkt, int32 partition)
{
	int			i;

	for (i = 0; i < nfetches; i++)
		if (fetches[i].rkt == rkt && fetches[i].partition == partition)
			return i;
	return -1;
}

/* stop fetches[i] and forget it (the last entry takes its place) */
static void
stop_fetch(int i)
{
	(void) rd_kafka_consume_stop(fetches[i].rkt, fetches[i].partition);
	fetches[i] = fetches[--nfetches];
}

/* stop the probe's fetch of (rkt, partition), if it runs */
static void
drop_fetch(rd_kafka_topic_t *rkt, int32 partition)
{
	int			i = find_fetch(rkt, partition);

	if (i >= 0)
		stop_fetch(i);
}

/*
 * Stop the probe's fetches of rkt (of every topic if NULL) last asked
 * before asked_before.
 */
static void
stop_fetches(rd_kafka_topic_t *rkt, TimestampTz asked_before)
{
	int			i = 0;

	while (i < nfetches)
	{
		if ((rkt == NULL || fetches[i].rkt == rkt) && fetches[i].asked < asked_before)
			stop_fetch(i);
		else
			i++;
	}
}

/*
 * inbox_witness_verify
 *		Before the batch's offsets advance: wait for the probe's answers (up
 *		to PROBE_TIMEOUT_MS in all).  Returns false when a partition of the
 *		batch holds another record at its witness's offset: that partition
 *		is stalled now (shown, logged), and the caller must roll the batch
 *		back and run it again without it.  Raises ERROR (08006) when Kafka
 *		did not answer: the batch is applied again later.
 */
bool
inbox_witness_verify(InboxSubscription *sub)
{
	TimestampTz deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), PROBE_TIMEOUT_MS);
	bool		same = true;
	int			i;

	for (;;)
	{
		bool		waiting = false;

		for (i = 0; i < nquestions; i++)
			if (questions[i].answer == ANSWER_WAITING)
				waiting = true;
		if (!waiting)
			break;
		if (GetCurrentTimestamp() >= deadline)
		{
			/* the next try starts these fetches afresh */
			for (i = 0; i < nquestions; i++)
				if (questions[i].answer == ANSWER_WAITING)
					drop_fetch(questions[i].rkt, questions[i].part->partition);
			forget_questions();
			ereport(ERROR,
					(errcode(ERRCODE_CONNECTION_FAILURE),
					 errmsg("Kafka did not show the last applied record of subscription \"%s\" within %d ms",
							sub->name, PROBE_TIMEOUT_MS),
					 errhint("The batch is rolled back and applied again.")));
		}
		CHECK_FOR_INTERRUPTS();

		/*
		 * The probe waits in librdkafka, not on the latch, so nothing else
		 * here notices a postmaster that died (kill -9): without this check
		 * an orphaned worker went on asking for minutes (test_37, seed 1)
		 * and held the shared memory the new postmaster must start without.
		 */
		if (!PostmasterIsAlive())
			proc_exit(1);
		for (i = 0; i < nquestions; i++)
		{
			Question   *q = &questions[i];

			if (q->answer != ANSWER_WAITING)
				continue;
			take_answer(q, 10);
			if (q->answer == ANSWER_WAITING && GetCurrentTimestamp() >= q->nudge_at)
			{
				/* see the file's header: a seek wakes an idle fetch */
				(void) rd_kafka_seek(q->rkt, q->part->partition, q->offset, 0);
				q->nudge_ms *= 2;
				q->nudge_at = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), q->nudge_ms);
			}
		}
	}
	for (i = 0; i < nquestions; i++)
		if (questions[i].answer == ANSWER_OTHER)
		{
			stall(sub, questions[i].part, true);
			same = false;
		}
	forget_questions();
	return same;
}

/* a record (or an error) of q's partition from the probe, if one comes in wait_ms */
static void
take_answer(Question *q, int wait_ms)
{
	rd_kafka_message_t *m = rd_kafka_consume(q->rkt, q->part->partition, wait_ms);

	rd_kafka_poll(probe, 0);
	if (m == NULL)
		return;
	if (m->err == RD_KAFKA_RESP_ERR__AUTO_OFFSET_RESET ||
		m->err == RD_KAFKA_RESP_ERR_OFFSET_OUT_OF_RANGE)
	{
		q->answer = ANSWER_CANNOT_TELL; /* retention passed it */
		/* the fetch ended (auto.offset.reset error): a seek would not move it */
		drop_fetch(q->rkt, q->part->partition);
	}
	else if (m->err != RD_KAFKA_RESP_ERR_NO_ERROR)
		;						/* end of partition, a broker hiccup: wait */
	else if (m->offset > q->offset)
		q->answer = ANSWER_CANNOT_TELL; /* compacted away */
	else if (m->offset == q->offset)
		q->answer = inbox_witness_hash(m) == q->hash ? ANSWER_SAME : ANSWER_OTHER;
	rd_kafka_message_destroy(m);
}

/* forget the questions; their fetches go on until the next seek */
static void
forget_questions(void)
{
	nquestions = 0;
}

/* the probe, built once per worker from the consumer's settings */
static bool
ensure_probe(InboxSubscription *sub)
{
	char	   *error = NULL;
	char		errstr[512];
	rd_kafka_conf_t *conf;

	if (probe != NULL)
		return true;
	conf = inbox_consumer_conf(sub, probe_settings, &error);
	if (conf == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_CONFIG_FILE_ERROR),
				 errmsg("could not configure the inbox's probe consumer: %s", error)));
	probe = rd_kafka_new(RD_KAFKA_CONSUMER, conf, errstr, sizeof(errstr));
	if (probe == NULL)
	{
		rd_kafka_conf_destroy(conf);
		ereport(ERROR,
				(errcode(ERRCODE_CONFIG_FILE_ERROR),
				 errmsg("could not create the inbox's probe consumer")));
	}
	return true;
}

/*
 * Stall p: show it, remember it across reloads (until a seek moves its
 * offset) and, the first time, log it.
 */
static void
stall(InboxSubscription *sub, InboxPartition *p, bool first)
{
	char	   *text = psprintf("the record at offset %lld is not the one applied there: the topic was deleted and created again; nothing is applied or skipped until outbox.inbox_seek('%s', '%s', %d, ...)",
								(long long) p->witness_offset, sub->name, p->topic, p->partition);

	if (first)
	{
		int			i;

		for (i = 0; i < nrecreated; i++)
			if (recreated[i].partition == p->partition &&
				recreated[i].next_offset == p->next_offset &&
				strcmp(recreated[i].topic, p->topic) == 0)
				break;
		if (i == nrecreated && nrecreated < RECREATED_MAX)
		{
			strlcpy(recreated[nrecreated].topic, p->topic, sizeof(recreated[0].topic));
			recreated[nrecreated].partition = p->partition;
			recreated[nrecreated].next_offset = p->next_offset;
			nrecreated++;
			ereport(WARNING,
					(errmsg("outbox inbox: subscription \"%s\", topic \"%s\", partition %d stalls",
							sub->name, p->topic, p->partition),
					 errdetail("%s.", text)));
		}
	}
	p->stalled = true;
	sub->reassign = true;
	inbox_status_set(p->status, INBOX_STATE_STALLED, text);
}

/*
 * inbox_witness_restall
 *		After sub's offsets were read again: stall the partitions found
 *		re-created at the offset they still have.
 */
void
inbox_witness_restall(InboxSubscription *sub)
{
	int			i;

	for (i = 0; i < nrecreated; i++)
	{
		InboxPartition *p = inbox_find_partition(sub, recreated[i].topic, recreated[i].partition);

		if (p != NULL && p->mine && p->witness_offset >= 0 &&
			p->next_offset == recreated[i].next_offset)
			stall(sub, p, false);
	}
}

/*
 * inbox_witness_destroy
 *		Drop the probe (at exit, or when the settings changed).  Raises no
 *		error; does not wait for brokers.
 */
void
inbox_witness_destroy(void)
{
	int			i;

	forget_questions();
	stop_fetches(NULL, DT_NOEND);
	for (i = 0; i < nprobe_topics; i++)
		rd_kafka_topic_destroy(probe_topics[i]);
	nprobe_topics = 0;
	if (probe != NULL)
		rd_kafka_destroy_flags(probe, RD_KAFKA_DESTROY_F_NO_CONSUMER_CLOSE);
	probe = NULL;
}

/* the probe's handle of topic name, kept (the oldest is dropped when full) */
static rd_kafka_topic_t *
probe_topic(const char *name)
{
	int			i;
	rd_kafka_topic_t *rkt;

	for (i = 0; i < nprobe_topics; i++)
		if (strcmp(rd_kafka_topic_name(probe_topics[i]), name) == 0)
			return probe_topics[i];
	rkt = rd_kafka_topic_new(probe, name, NULL);
	if (rkt == NULL)
		return NULL;
	if (nprobe_topics == PROBE_TOPICS)
	{
		/* drop the oldest handle that no question of this batch uses */
		for (i = 0; i < nprobe_topics; i++)
		{
			int			q;

			for (q = 0; q < nquestions && questions[q].rkt != probe_topics[i]; q++)
				;
			if (q == nquestions)
				break;
		}
		if (i == nprobe_topics)
		{
			/* cannot happen (fewer questions than handles): cannot tell */
			rd_kafka_topic_destroy(rkt);
			return NULL;
		}
		/* librdkafka: a topic handle goes after its partitions' fetches */
		stop_fetches(probe_topics[i], DT_NOEND);
		rd_kafka_topic_destroy(probe_topics[i]);
		memmove(&probe_topics[i], &probe_topics[i + 1],
				sizeof(probe_topics[0]) * (nprobe_topics - i - 1));
		nprobe_topics--;
	}
	probe_topics[nprobe_topics++] = rkt;
	return rkt;
}
