/*-------------------------------------------------------------------------
 *
 * inbox_consumer.c
 *	  The inbox's Kafka consumers, built on librdkafka: one per inbox
 *	  worker, created in it (never in the postmaster).
 *
 * Offsets live in the database (inbox_offsets.c), so a consumer never
 * joins a consumer group and never commits: the worker assigns it every
 * partition of its topics explicitly (rd_kafka_assign), each at the offset
 * read from outbox.inbox_offsets, and assigns again from the table after
 * anything that may have moved them (a seek, a rolled-back batch, new
 * partitions: inbox_assign.c).  This is Kafka's "storing offsets outside Kafka" recipe with
 * a static assignment instead of a rebalance callback: there is no group to
 * rebalance, so no member can be evicted during a long transaction, and two
 * databases can never split a topic's partitions between them.  (A group.id
 * is set only because librdkafka 2.0.2 wants one to assign; nothing joins
 * or commits under it.)
 *
 * auto.offset.reset is "error": a stored offset Kafka no longer has (its
 * retention passed it, the topic was re-created) stalls that partition with
 * a visible state instead of jumping anywhere; outbox.inbox_seek() is the
 * way on.  isolation.level is read_committed: records of an aborted Kafka
 * transaction are never applied.
 *
 * librdkafka's callbacks (errors, log lines) are served on the worker's own
 * thread by rd_kafka_poll() and only copy text into the consumer: no palloc,
 * no ereport there.  Both of its queues write a byte to the worker's wake-up
 * pipe when records or events arrive.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "inbox/inbox.h"
#include "inbox/inbox_consumer_int.h"
#include "config/kafka_config.h"
#include "config/secrets.h"

#include "miscadmin.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

/*
 * Defaults the inbox sets before outbox.inbox_kafka_properties; the first
 * ones are reserved (inbox_guc.c) because the guarantees rest on them.
 */
static const char *const consumer_defaults[][2] = {
	{"enable.auto.commit", "false"},
	{"enable.auto.offset.store", "false"},
	{"auto.offset.reset", "error"},
	{"isolation.level", "read_committed"},
	{"enable.partition.eof", "false"},
	{"log.queue", "true"},
	{"sasl.kerberos.min.time.before.relogin", "0"},
	{"client.id", "outbox-inbox"},
	/* bound the records fetched ahead per consumer (default 64 MB) */
	{"queued.max.messages.kbytes", "16384"},
	{"socket.keepalive.enable", "true"},
	{"socket.nagle.disable", "true"},
	/* new partitions of assigned topics are also found by the worker's own look */
	{"topic.metadata.refresh.interval.ms", "10000"},
	{NULL, NULL}
};

static bool set_conf(rd_kafka_conf_t *conf, const char *key, const char *value,
					 char **error);
static void error_cb(rd_kafka_t *rk, int err, const char *reason, void *opaque);
static void log_cb(const rd_kafka_t *rk, int level, const char *fac,
				   const char *buf);
static void serve_main_queue(InboxConsumer *c);

/*
 * inbox_consumer_conf
 *		A librdkafka configuration for a consumer of sub from the current
 *		settings: the defaults above, outbox.inbox_kafka_properties, then
 *		extra (NULL-terminated key/value pairs, or NULL).  Returns NULL with
 *		*error set (palloc'd, free of secret values) when a property is
 *		unknown or invalid.
 */
rd_kafka_conf_t *
inbox_consumer_conf(InboxSubscription *sub, const char *const (*extra)[2],
					char **error)
{
	rd_kafka_conf_t *conf = rd_kafka_conf_new();
	OutboxKafkaProperty *props;
	int			nprops;
	char		group[256];
	int			i;

	if (!outbox_parse_properties(outbox_inbox_kafka_properties,
								 outbox_inbox_reserved_properties(), "the inbox",
								 &props, &nprops, error))
	{
		*error = psprintf("outbox.inbox_kafka_properties: %s", *error);
		rd_kafka_conf_destroy(conf);
		return NULL;
	}
	snprintf(group, sizeof(group), "outbox-inbox-%u-%s", MyDatabaseId, sub->name);
	if (!set_conf(conf, "bootstrap.servers", outbox_inbox_servers(), error) ||
		!set_conf(conf, "group.id", group, error))
	{
		rd_kafka_conf_destroy(conf);
		return NULL;
	}
	for (i = 0; consumer_defaults[i][0] != NULL; i++)
		if (!set_conf(conf, consumer_defaults[i][0], consumer_defaults[i][1], error))
		{
			rd_kafka_conf_destroy(conf);
			return NULL;
		}
	for (i = 0; i < nprops; i++)
		if (!set_conf(conf, props[i].key, props[i].value, error))
		{
			*error = psprintf("outbox.inbox_kafka_properties: %s", *error);
			rd_kafka_conf_destroy(conf);
			return NULL;
		}
	for (i = 0; extra != NULL && extra[i][0] != NULL; i++)
		if (!set_conf(conf, extra[i][0], extra[i][1], error))
		{
			rd_kafka_conf_destroy(conf);
			return NULL;
		}
	return conf;
}

/*
 * inbox_consumer_create
 *		A consumer for sub from the current settings, whose queues write to
 *		wakeup_fd when something arrives.  Returns NULL with *error set
 *		(palloc'd, free of secret values) when a property is unknown or
 *		invalid or librdkafka refuses the configuration.
 */
InboxConsumer *
inbox_consumer_create(InboxSubscription *sub, int wakeup_fd, char **error)
{
	rd_kafka_conf_t *conf = inbox_consumer_conf(sub, NULL, error);
	InboxConsumer *c;
	char		errstr[512];
	rd_kafka_queue_t *mainq;

	if (conf == NULL)
		return NULL;
	c = MemoryContextAllocZero(TopMemoryContext, sizeof(InboxConsumer));
	rd_kafka_conf_set_opaque(conf, c);
	rd_kafka_conf_set_error_cb(conf, error_cb);
	rd_kafka_conf_set_log_cb(conf, log_cb);
	c->rk = rd_kafka_new(RD_KAFKA_CONSUMER, conf, errstr, sizeof(errstr));
	if (c->rk == NULL)
	{
		rd_kafka_conf_destroy(conf);
		pfree(c);
		outbox_kafka_scrub_secrets(errstr, sizeof(errstr), outbox_inbox_kafka_properties);
		*error = psprintf("could not create the Kafka consumer: %s", errstr);
		return NULL;
	}
	rd_kafka_set_log_queue(c->rk, NULL);
	c->queue = rd_kafka_queue_get_consumer(c->rk);
	if (c->queue == NULL)
	{
		inbox_consumer_destroy(c);
		*error = pstrdup("librdkafka gave the consumer no queue");
		return NULL;
	}
	rd_kafka_queue_io_event_enable(c->queue, wakeup_fd, "1", 1);
	mainq = rd_kafka_queue_get_main(c->rk);
	rd_kafka_queue_io_event_enable(mainq, wakeup_fd, "1", 1);
	rd_kafka_queue_destroy(mainq);
	c->servers = MemoryContextStrdup(TopMemoryContext, outbox_inbox_servers());
	c->properties = MemoryContextStrdup(TopMemoryContext, outbox_inbox_kafka_properties);
	return c;
}

/*
 * One property; false with *error set when librdkafka does not know the key
 * or refuses the value (shown only when the key is not secret).
 */
static bool
set_conf(rd_kafka_conf_t *conf, const char *key, const char *value, char **error)
{
	char		errstr[512];
	rd_kafka_conf_res_t res = rd_kafka_conf_set(conf, key, value, errstr, sizeof(errstr));

	if (res == RD_KAFKA_CONF_OK)
		return true;
	if (res == RD_KAFKA_CONF_UNKNOWN)
		*error = psprintf("unknown librdkafka property \"%s\"", key);
	else if (outbox_kafka_property_is_secret(key))
		*error = psprintf("invalid value for librdkafka property \"%s\"", key);
	else
		*error = psprintf("invalid value for librdkafka property \"%s\": %s", key, errstr);
	return false;
}

/*
 * inbox_consumer_destroy
 *		Drop the consumer: what it fetched ahead is thrown away (the offsets
 *		in the table say where to start again).  NULL is fine.  Raises no
 *		ERROR; does not wait for brokers.
 */
void
inbox_consumer_destroy(InboxConsumer *c)
{
	if (c == NULL)
		return;
	if (c->queue != NULL)
		rd_kafka_queue_destroy(c->queue);
	if (c->given != NULL)
		rd_kafka_topic_partition_list_destroy(c->given);
	if (c->rk != NULL)
		rd_kafka_destroy_flags(c->rk, RD_KAFKA_DESTROY_F_NO_CONSUMER_CLOSE);
	if (c->servers)
		pfree(c->servers);
	if (c->properties)
		pfree(c->properties);
	pfree(c);
}

/*
 * inbox_consumer_settings_changed
 *		Did a reload change what the consumer was built with?
 */
bool
inbox_consumer_settings_changed(InboxConsumer *c)
{
	return strcmp(c->servers, outbox_inbox_servers()) != 0 ||
		strcmp(c->properties, outbox_inbox_kafka_properties) != 0;
}

/*
 * A consumer error for one partition: a stored offset Kafka does not have
 * stalls the partition (it is left out of the next assignment); any other
 * is shown on the partition, or on the worker when it names none.  msgs
 * holds the good records polled before m (n of them), not yet applied.
 *
 * An offset error names the offset the fetch failed at.  One that is not
 * where the partition's consumer is now (its next offset, or after the
 * last of its records in msgs) comes from an assignment replaced since (a
 * seek to 1000000 followed at once by one to the end): the partition's
 * fetcher now is another, so it is dropped instead of stalling the
 * partition at an offset Kafka has.
 */
static void
partition_error(InboxSubscription *sub, rd_kafka_message_t *m,
				rd_kafka_message_t **msgs, int n)
{
	InboxPartition *p = NULL;
	const char *why = rd_kafka_message_errstr(m);

	if (m->rkt != NULL)
		p = inbox_find_partition(sub, rd_kafka_topic_name(m->rkt), m->partition);
	if (m->err == RD_KAFKA_RESP_ERR__AUTO_OFFSET_RESET && p != NULL)
	{
		int64		at = p->next_offset;
		int64		low = -1,
					high = -1;
		char	   *text;
		int			i;

		for (i = 0; i < n; i++)
			if (msgs[i]->partition == p->partition && msgs[i]->offset >= at &&
				strcmp(rd_kafka_topic_name(msgs[i]->rkt), p->topic) == 0)
				at = msgs[i]->offset + 1;
		if (at >= 0 && m->offset >= 0 && m->offset != at)
		{
			ereport(DEBUG1,
					(errmsg("outbox inbox: subscription \"%s\", topic \"%s\", partition %d: dropped an offset error at %lld of an earlier assignment (the consumer is at %lld)",
							sub->name, p->topic, p->partition, (long long) m->offset, (long long) at)));
			return;
		}
		if (m->offset >= 0)
			at = m->offset;
		if (p->stalled)
			return;
		/* past the end, or before the first: ask Kafka which, once per stall */
		if (at >= 0 && sub->consumer != NULL)
			(void) rd_kafka_query_watermark_offsets(sub->consumer->rk, p->topic, p->partition,
													&low, &high, 2000);
		if (at >= 0 && high >= 0 && at > high && p->witness_offset >= high)
		{
			/* the last record applied is past the end: Kafka lost it */
			text = psprintf("Kafka no longer has offset %lld, the last one applied: the partition ends at %lld, so the topic was deleted and created again (or lost records); nothing is applied or skipped until outbox.inbox_seek('%s', '%s', %d, ...)",
							(long long) p->witness_offset, (long long) high, sub->name, p->topic, p->partition);
		}
		else if (at >= 0 && high >= 0 && at > high)
			text = psprintf("offset %lld is not yet in Kafka: the partition ends at %lld; nothing is applied or skipped until outbox.inbox_seek('%s', '%s', %d, ...)",
							(long long) at, (long long) high, sub->name, p->topic, p->partition);
		else if (at >= 0 && low >= 0 && at < low)
			text = psprintf("Kafka no longer has offset %lld: the partition begins at %lld; nothing is applied or skipped until outbox.inbox_seek('%s', '%s', %d, ...)",
							(long long) at, (long long) low, sub->name, p->topic, p->partition);
		else
			text = psprintf("Kafka has no offset %lld (%s); nothing is applied or skipped until outbox.inbox_seek('%s', '%s', %d, ...)",
							(long long) at, why, sub->name, p->topic, p->partition);
		ereport(WARNING,
				(errmsg("outbox inbox: subscription \"%s\", topic \"%s\", partition %d stalls",
						sub->name, p->topic, p->partition),
				 errdetail("%s.", text)));
		p->stalled = true;
		sub->reassign = true;
		inbox_status_set(p->status, INBOX_STATE_STALLED, text);
		return;
	}
	if (m->err == RD_KAFKA_RESP_ERR__PARTITION_EOF)
		return;
	if (p != NULL)
		inbox_status_set(p->status, INBOX_STATE_ERROR, why);
	else
		inbox_set_state(INBOX_STATE_RUNNING, why);
}

/*
 * inbox_consumer_poll
 *		Up to max records of sub into msgs (the caller destroys them), waiting
 *		up to wait_ms (ms) to fill the batch once one record is there; 0 if
 *		none is waiting.  Consumer errors are handled here (stalled
 *		partitions, see partition_error), and librdkafka's errors and log
 *		lines are served.
 */
int
inbox_consumer_poll(InboxSubscription *sub, rd_kafka_message_t **msgs, int max,
					int wait_ms)
{
	InboxConsumer *c = sub->consumer;
	ssize_t		n;
	int			good = 0;
	int			i;

	if (c == NULL)
		return 0;
	serve_main_queue(c);
	n = rd_kafka_consume_batch_queue(c->queue, 0, msgs, max);
	if (n > 0 && n < max && wait_ms > 0)
	{
		ssize_t		more = rd_kafka_consume_batch_queue(c->queue, wait_ms, msgs + n, max - n);

		if (more > 0)
			n += more;
	}
	for (i = 0; i < n; i++)
	{
		if (msgs[i]->err == RD_KAFKA_RESP_ERR_NO_ERROR)
		{
			msgs[good++] = msgs[i];
			continue;
		}
		partition_error(sub, msgs[i], msgs, good);
		rd_kafka_message_destroy(msgs[i]);
	}
	if (good > 0)
		c->brokers_down = false;
	return good;
}

/*
 * Serve librdkafka's main queue (errors, log lines) and log what the
 * callbacks kept.
 */
static void
serve_main_queue(InboxConsumer *c)
{
	int			i;

	rd_kafka_poll(c->rk, 0);
	/* librdkafka may quote a property's value: never a secret's (as the relay) */
	if (c->error_unscrubbed)
		outbox_kafka_scrub_secrets(c->error, sizeof(c->error), c->properties);
	c->error_unscrubbed = false;
	for (i = 0; i < c->nlogs; i++)
	{
		outbox_kafka_scrub_secrets(c->logs[i], sizeof(c->logs[i]), c->properties);
		ereport(LOG, (errmsg("outbox inbox: librdkafka: %s", c->logs[i])));
	}
	c->nlogs = 0;
}

/*
 * inbox_consumer_refresh
 *		Ask Kafka for the partitions of each of sub's topics (waiting up to
 *		timeout_ms each) and add the new ones to the table and the list:
 *		before the subscription's first start at its start_from, after it at
 *		their first offset.  A topic that does not exist shows as
 *		waiting_for_topic.  Returns false when Kafka did not answer (the
 *		worker shows broker_down).  Call in a transaction with SPI connected.
 */
bool
inbox_consumer_refresh(InboxSubscription *sub, int timeout_ms)
{
	InboxConsumer *c = sub->consumer;
	bool		added = false;
	int			t;

	if (c == NULL)
		return false;
	inbox_lock_subscription(sub);
	for (t = 0; t < sub->ntopics; t++)
	{
		rd_kafka_topic_t *rkt = rd_kafka_topic_new(c->rk, sub->topics[t], NULL);
		const struct rd_kafka_metadata *md = NULL;
		rd_kafka_resp_err_t err;
		int			p;

		/* a stop waits for one topic's request (timeout_ms) at most */
		CHECK_FOR_INTERRUPTS();
		if (rkt == NULL)
			continue;
		err = rd_kafka_metadata(c->rk, 0, rkt, &md, timeout_ms);
		rd_kafka_topic_destroy(rkt);
		if (err != RD_KAFKA_RESP_ERR_NO_ERROR)
		{
			snprintf(c->error, sizeof(c->error), "could not read the metadata of topic \"%s\": %s",
					 sub->topics[t], rd_kafka_err2str(err));
			c->brokers_down = true;
			return false;
		}
		if (md->topic_cnt != 1 || md->topics[0].err != RD_KAFKA_RESP_ERR_NO_ERROR)
		{
			inbox_note_missing_topic(sub, sub->topics[t]);
			rd_kafka_metadata_destroy(md);
			continue;
		}
		for (p = 0; p < md->topics[0].partition_cnt; p++)
		{
			int32		id = md->topics[0].partitions[p].id;

			if (inbox_find_partition(sub, sub->topics[t], id) != NULL)
				continue;
			inbox_offsets_insert(sub, sub->topics[t], id,
								 inbox_start_offset(sub, sub->topics[t], id));
			added = true;
		}
		inbox_forget_missing_topic(sub, sub->topics[t]);
		rd_kafka_metadata_destroy(md);
	}
	c->brokers_down = false;
	if (!sub->started)
		inbox_mark_started(sub);
	if (added)
		sub->reassign = true;
	return true;
}

/*
 * inbox_consumer_resolve_time
 *		The first offset of (topic, partition) whose record is at or after
 *		when (its end if none is, its first offset for -infinity), from Kafka,
 *		into *offset; false when Kafka did not answer within 5 s.
 */
bool
inbox_consumer_resolve_time(InboxSubscription *sub, const char *topic,
							int32 partition, TimestampTz when, int64 *offset)
{
	rd_kafka_topic_partition_list_t *list;
	rd_kafka_resp_err_t err;
	int64		ms;

	if (sub->consumer == NULL)
		return false;
	if (TIMESTAMP_IS_NOBEGIN(when))
		ms = 0;
	else if (TIMESTAMP_IS_NOEND(when))
	{
		*offset = -1;
		return true;
	}
	else
		ms = (when + ((int64) (POSTGRES_EPOCH_JDATE - UNIX_EPOCH_JDATE) * USECS_PER_DAY)) / 1000;
	list = rd_kafka_topic_partition_list_new(1);
	rd_kafka_topic_partition_list_add(list, topic, partition)->offset = Max(ms, 0);
	err = rd_kafka_offsets_for_times(sub->consumer->rk, list, 5000);
	if (err == RD_KAFKA_RESP_ERR_NO_ERROR)
		err = list->elems[0].err;
	*offset = list->elems[0].offset;
	rd_kafka_topic_partition_list_destroy(list);
	if (err != RD_KAFKA_RESP_ERR_NO_ERROR)
		return false;
	/* no record that late: the end */
	if (*offset < 0)
		*offset = -1;
	return true;
}

/*
 * inbox_consumer_resolve_start / inbox_consumer_resolve_end
 *		The first offset Kafka has of (topic, partition), or its end (the
 *		offset the next record will get), into *offset; false when Kafka did
 *		not answer within 2 s.  A request to the partition's leader.
 */
bool
inbox_consumer_resolve_start(InboxSubscription *sub, const char *topic,
							 int32 partition, int64 *offset)
{
	int64		high;

	return sub->consumer != NULL &&
		rd_kafka_query_watermark_offsets(sub->consumer->rk, topic, partition,
										 offset, &high, 2000) == RD_KAFKA_RESP_ERR_NO_ERROR;
}

bool
inbox_consumer_resolve_end(InboxSubscription *sub, const char *topic,
						   int32 partition, int64 *offset)
{
	int64		low;

	return sub->consumer != NULL &&
		rd_kafka_query_watermark_offsets(sub->consumer->rk, topic, partition,
										 &low, offset, 2000) == RD_KAFKA_RESP_ERR_NO_ERROR;
}

/*
 * inbox_consumer_watermarks
 *		Show each assigned partition's high watermark as librdkafka last
 *		heard it from a fetch (no request is made).
 */
void
inbox_consumer_watermarks(InboxSubscription *sub)
{
	int			i;

	if (sub->consumer == NULL)
		return;
	for (i = 0; i < sub->npartitions; i++)
	{
		InboxPartition *p = &sub->partitions[i];
		int64		low,
					high;

		if (p->mine && rd_kafka_get_watermark_offsets(sub->consumer->rk, p->topic, p->partition,
										   &low, &high) == RD_KAFKA_RESP_ERR_NO_ERROR &&
			high >= 0)
			inbox_status_watermark(p->status, high);
	}
}

/*
 * inbox_consumer_broker_down
 *		Does sub's consumer reach no broker?  If so, why, into why (len
 *		bytes).
 */
bool
inbox_consumer_broker_down(InboxSubscription *sub, char *why, size_t len)
{
	if (sub->consumer == NULL || !sub->consumer->brokers_down)
		return false;
	strlcpy(why, sub->consumer->error[0] ? sub->consumer->error : "all brokers are down", len);
	return true;
}

/*
 * The error callback, served by rd_kafka_poll() on the worker's thread:
 * only copies.  Every broker down marks the consumer down until a record
 * or a metadata answer comes.
 */
static void
error_cb(rd_kafka_t *rk, int err, const char *reason, void *opaque)
{
	InboxConsumer *c = (InboxConsumer *) opaque;

	snprintf(c->error, sizeof(c->error), "%s", reason);
	c->error_unscrubbed = true;
	if (err == RD_KAFKA_RESP_ERR__ALL_BROKERS_DOWN)
		c->brokers_down = true;
}

/* librdkafka's log lines, kept for serve_main_queue() to log */
static void
log_cb(const rd_kafka_t *rk, int level, const char *fac, const char *buf)
{
	InboxConsumer *c = (InboxConsumer *) rd_kafka_opaque(rk);

	if (c == NULL || c->nlogs >= CONSUMER_LOG_LINES)
		return;
	snprintf(c->logs[c->nlogs++], sizeof(c->logs[0]), "%d %s: %s", level, fac, buf);
}
