/*-------------------------------------------------------------------------
 *
 * topic_cache.c
 *	  The relay producer's topic handles, one per topic, and what the
 *	  cluster said about each topic: known, or refused (not authorized, does
 *	  not exist and will not be created).
 *
 * The cache is a hash table in TopMemoryContext, owned by the producer
 * (producer.c), which creates it with its librdkafka handle and destroys
 * it before that handle.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "kafka/topic_cache.h"

#include "miscadmin.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

/* topics whose handles we keep; past this, each message looks its topic up */
#define MAX_CACHED_TOPICS	10000

/* how long the first message to a topic may wait for its metadata */
#define TOPIC_METADATA_TIMEOUT_MS	500

/* how long a topic error from the metadata is trusted before asking again */
#define TOPIC_ERROR_RECHECK_MS	1000

/* how long a new topic may take to be auto-created by the broker */
#define TOPIC_CREATE_WAIT_MS	1500
#define TOPIC_CREATE_POLL_MS	50

typedef struct TopicEntry
{
	char		name[OUTBOX_TOPIC_MAX_LEN + 1];	/* hash key */
	rd_kafka_topic_t *rkt;
	rd_kafka_resp_err_t error;	/* topic refused by the cluster, or 0 */
	TimestampTz checked_at;		/* when error was last looked up */
} TopicEntry;

static void check_topic(rd_kafka_t *rk, bool brokers_down, TopicEntry *entry);
static void wait_for_topic_creation(rd_kafka_t *rk, bool brokers_down,
									TopicEntry *entry);

/*
 * outbox_topic_cache_create
 *		A new, empty cache of topic handles, in TopMemoryContext.  Raises
 *		ERROR only when out of memory.
 */
struct HTAB *
outbox_topic_cache_create(void)
{
	HASHCTL		ctl;

	ctl.keysize = OUTBOX_TOPIC_MAX_LEN + 1;
	ctl.entrysize = sizeof(TopicEntry);
	ctl.hcxt = TopMemoryContext;
	return hash_create("outbox relay topics", 64, &ctl,
					   HASH_ELEM | HASH_STRINGS | HASH_CONTEXT);
}

/*
 * outbox_topic_cache_destroy
 *		Destroy every topic handle of cache, then the cache.  Call before
 *		rd_kafka_destroy() of the handle they were created with.
 */
void
outbox_topic_cache_destroy(struct HTAB *cache)
{
	HASH_SEQ_STATUS seq;
	TopicEntry *entry;

	hash_seq_init(&seq, cache);
	while ((entry = hash_seq_search(&seq)) != NULL)
		rd_kafka_topic_destroy(entry->rkt);
	hash_destroy(cache);
}

/*
 * outbox_topic_handle
 *		The handle of topic name in cache, created on first use with rk, and
 *		whether the cluster refuses the topic (*error: a Kafka error code, or
 *		RD_KAFKA_RESP_ERR_NO_ERROR).  brokers_down: no broker answers, so
 *		the topic's metadata is not asked for (the producer's
 *		all_brokers_down, set by its error callback, which runs only inside
 *		rd_kafka_poll(), so never while this waits).
 *
 * librdkafka looks up unknown topics only about once a second, so the first
 * message to each topic would wait up to a second; asking for the topic's
 * metadata right away makes that a round trip instead.  The same answer
 * tells whether the topic is refused (not authorized, does not exist and
 * will not be created): librdkafka would only let such messages time out,
 * which looks like a broker outage; the relay fails them at once instead,
 * as a permanent error.  A refusal is looked up again after
 * TOPIC_ERROR_RECHECK_MS, so a fixed ACL or a created topic is noticed.
 *
 * Returns NULL when the cache is full: the caller then names the topic per
 * message.  (Also for a name longer than a topic's, and when librdkafka
 * cannot create the handle.)  The first lookup of a topic may wait for its
 * metadata, up to TOPIC_METADATA_TIMEOUT_MS, and for its creation, up to
 * TOPIC_CREATE_WAIT_MS more.  Raises no ERROR of its own.
 */
rd_kafka_topic_t *
outbox_topic_handle(rd_kafka_t *rk, struct HTAB *cache, const char *name,
					bool brokers_down, rd_kafka_resp_err_t *error)
{
	TopicEntry *entry;
	bool		found;

	*error = RD_KAFKA_RESP_ERR_NO_ERROR;
	if (strlen(name) > OUTBOX_TOPIC_MAX_LEN)
		return NULL;
	entry = hash_search(cache, name, HASH_FIND, NULL);
	if (entry == NULL)
	{
		if (hash_get_num_entries(cache) >= MAX_CACHED_TOPICS)
			return NULL;
		entry = hash_search(cache, name, HASH_ENTER, &found);
		entry->rkt = rd_kafka_topic_new(rk, name, NULL);
		entry->error = RD_KAFKA_RESP_ERR_NO_ERROR;
		if (entry->rkt == NULL)
		{
			hash_search(cache, name, HASH_REMOVE, NULL);
			return NULL;
		}
		check_topic(rk, brokers_down, entry);
		wait_for_topic_creation(rk, brokers_down, entry);
	}
	else if (entry->error != RD_KAFKA_RESP_ERR_NO_ERROR &&
			 TimestampDifferenceExceeds(entry->checked_at, GetCurrentTimestamp(),
										TOPIC_ERROR_RECHECK_MS))
		check_topic(rk, brokers_down, entry);

	*error = entry->error;
	return entry->rkt;
}

/*
 * Ask the cluster about one topic, waiting at most TOPIC_METADATA_TIMEOUT_MS,
 * and remember whether it refuses the topic.  Errors of the request itself
 * (no broker answered) say nothing about the topic and are not kept.
 */
static void
check_topic(rd_kafka_t *rk, bool brokers_down, TopicEntry *entry)
{
	const struct rd_kafka_metadata *md = NULL;

	entry->checked_at = GetCurrentTimestamp();
	if (brokers_down)
		return;					/* not worth a wait when no broker answers */
	if (rd_kafka_metadata(rk, 0, entry->rkt, &md,
						  TOPIC_METADATA_TIMEOUT_MS) != RD_KAFKA_RESP_ERR_NO_ERROR)
		return;
	entry->error = RD_KAFKA_RESP_ERR_NO_ERROR;
	if (md->topic_cnt == 1)
	{
		switch (md->topics[0].err)
		{
			case RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED:
			case RD_KAFKA_RESP_ERR_TOPIC_EXCEPTION:
			case RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART:
				entry->error = md->topics[0].err;
				break;
			default:
				break;
		}
	}
	rd_kafka_metadata_destroy(md);
}

/*
 * A broker with auto.create.topics.enable answers the first metadata
 * request for a new topic with UNKNOWN_TOPIC_OR_PART and creates it
 * meanwhile: ask again for a moment before taking the topic as refused, so
 * that the first event to a new topic does not count as a failed attempt.
 * Done once per topic and producer; a topic that stays unknown costs
 * TOPIC_CREATE_WAIT_MS once.
 */
static void
wait_for_topic_creation(rd_kafka_t *rk, bool brokers_down, TopicEntry *entry)
{
	int			waited = 0;

	while (entry->error == RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART &&
		   waited < TOPIC_CREATE_WAIT_MS)
	{
		/* interrupts are held during a batch (batch.c): look for SIGTERM */
		if (ProcDiePending)
			return;
		CHECK_FOR_INTERRUPTS();
		pg_usleep(TOPIC_CREATE_POLL_MS * 1000L);
		waited += TOPIC_CREATE_POLL_MS;
		check_topic(rk, brokers_down, entry);
	}
}
