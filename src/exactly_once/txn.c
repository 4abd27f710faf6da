/*-------------------------------------------------------------------------
 *
 * txn.c
 *	  The transactional producer's calls for outbox.delivery = exactly_once:
 *	  init, begin, commit and abort of Kafka transactions, and the check of
 *	  the progress topic (admin API).
 *
 * librdkafka's transactional calls block.  Each is made here in steps of
 * at most STEP_MS, which librdkafka allows ("resumable when a retriable
 * timeout error is returned"), so that between two steps the worker
 * still answers the procsignal barriers DROP DATABASE waits for, and stops
 * waiting on SIGTERM.  The errors are sorted the way librdkafka's
 * documentation asks (INTRODUCTION.md, "Transactional Producer"):
 * retriable, abortable (abort and send the batch again), and everything
 * else fatal (the producer is rebuilt, which fences nobody but itself and
 * reads the progress back: exactly_once.c).
 *
 * Only the worker's own thread runs this; reports are served by the
 * calls themselves or by outbox_producer_serve().
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "exactly_once/txn.h"
#include "kafka/broker_call.h"
#include "kafka/producer.h"

#include "miscadmin.h"
#include "storage/procsignal.h"
#include "utils/timestamp.h"

#define STEP_MS		500

typedef rd_kafka_error_t *(*TxnCall) (rd_kafka_t *rk, int timeout_ms);

static OutboxTxnOutcome run_in_steps(OutboxProducer *producer, TxnCall call,
									 const char *what, int timeout_ms,
									 char **error);
static OutboxTxnOutcome classify(OutboxProducer *producer, rd_kafka_error_t *err,
								 const char *what, char **error);
static rd_kafka_event_t *admin_wait(rd_kafka_queue_t *queue, const char *what,
									const char *topic, int timeout_ms,
									char **refusal, bool *unavailable);
static char *describe_topic(OutboxProducer *producer, const char *topic,
							int timeout_ms, bool *missing, bool *unavailable);
static char *create_topic(OutboxProducer *producer, const char *topic,
						  int timeout_ms, bool *unavailable);
static char *count_partitions(OutboxProducer *producer, const char *topic,
							  int timeout_ms, bool *unavailable);

static rd_kafka_error_t *
call_init(rd_kafka_t *rk, int timeout_ms)
{
	return rd_kafka_init_transactions(rk, timeout_ms);
}

static rd_kafka_error_t *
call_commit(rd_kafka_t *rk, int timeout_ms)
{
	return rd_kafka_commit_transaction(rk, timeout_ms);
}

static rd_kafka_error_t *
call_abort(rd_kafka_t *rk, int timeout_ms)
{
	return rd_kafka_abort_transaction(rk, timeout_ms);
}

/*
 * outbox_txn_init
 *		rd_kafka_init_transactions(): get a producer id and epoch for the
 *		producer's transactional.id, which aborts (or completes) what an
 *		earlier producer with that id left open and fences it.  Waits at
 *		most timeout_ms (ms).  *error (palloc'd) says why when the outcome
 *		is not OUTBOX_TXN_OK.  Raises no ERROR, but the wait ends on SIGTERM
 *		through CHECK_FOR_INTERRUPTS() when interrupts are not held.
 */
OutboxTxnOutcome
outbox_txn_init(OutboxProducer *producer, int timeout_ms, char **error)
{
	return run_in_steps(producer, call_init, "initializing transactions",
						timeout_ms, error);
}

/*
 * outbox_txn_begin
 *		rd_kafka_begin_transaction(); it does not block.
 */
OutboxTxnOutcome
outbox_txn_begin(OutboxProducer *producer, char **error)
{
	rd_kafka_error_t *err = rd_kafka_begin_transaction(producer->rk);

	if (err == NULL)
		return OUTBOX_TXN_OK;
	return classify(producer, err, "beginning a transaction", error);
}

/*
 * outbox_txn_commit
 *		rd_kafka_commit_transaction(): flush what the transaction produced
 *		and commit it.  Call it after every delivery report came in, so that
 *		it only has to end the transaction.  Waits at most timeout_ms (ms).
 *		After OUTBOX_TXN_UNAVAILABLE it is not known whether the commit
 *		happened: the caller rebuilds the producer, which reads the progress
 *		back (exactly_once.c).
 */
OutboxTxnOutcome
outbox_txn_commit(OutboxProducer *producer, int timeout_ms, char **error)
{
	return run_in_steps(producer, call_commit, "committing a transaction",
						timeout_ms, error);
}

/*
 * outbox_txn_abort
 *		rd_kafka_abort_transaction(): purge what is not yet sent and mark
 *		what was written aborted, so no read_committed consumer sees it.
 *		Waits at most timeout_ms (ms).
 */
OutboxTxnOutcome
outbox_txn_abort(OutboxProducer *producer, int timeout_ms, char **error)
{
	OutboxTxnOutcome outcome;

	outcome = run_in_steps(producer, call_abort, "aborting a transaction",
						   timeout_ms, error);
	/* the purged messages' reports belong to no batch any more */
	producer->generation++;
	producer->outstanding = 0;
	return outcome;
}

/*
 * Make a resumable transactional call in steps of STEP_MS until it is done,
 * fails otherwise, timeout_ms passed, or SIGTERM came.
 */
static OutboxTxnOutcome
run_in_steps(OutboxProducer *producer, TxnCall call, const char *what,
			 int timeout_ms, char **error)
{
	TimestampTz start = GetCurrentTimestamp();

	for (;;)
	{
		rd_kafka_error_t *err = call(producer->rk, STEP_MS);

		outbox_producer_serve(producer);
		if (err == NULL)
			return OUTBOX_TXN_OK;
		if (!rd_kafka_error_is_retriable(err) ||
			TimestampDifferenceExceeds(start, GetCurrentTimestamp(), timeout_ms) ||
			ProcDiePending)
			return classify(producer, err, what, error);
		rd_kafka_error_destroy(err);
		if (ProcSignalBarrierPending)
			ProcessProcSignalBarrier();
		CHECK_FOR_INTERRUPTS();
	}
}

/*
 * Sort a transactional error, put its text into *error, and free it.
 */
static OutboxTxnOutcome
classify(OutboxProducer *producer, rd_kafka_error_t *err, const char *what,
		 char **error)
{
	OutboxTxnOutcome outcome;

	*error = psprintf("Kafka transaction failed while %s: %s: %s", what,
					  rd_kafka_error_name(err), rd_kafka_error_string(err));
	if (rd_kafka_error_is_fatal(err))
		outcome = OUTBOX_TXN_FATAL;
	else if (rd_kafka_error_txn_requires_abort(err))
		outcome = OUTBOX_TXN_ABORTABLE;
	else if (rd_kafka_error_is_retriable(err))
		outcome = OUTBOX_TXN_UNAVAILABLE;
	else
		outcome = OUTBOX_TXN_FATAL; /* librdkafka: treat the rest as fatal */
	if (outcome == OUTBOX_TXN_FATAL)
	{
		producer->fatal = true;
		/* the reason the relay logs when it rebuilds the producer */
		strlcpy(producer->last_error_text, *error,
				sizeof(producer->last_error_text));
	}
	rd_kafka_error_destroy(err);
	return outcome;
}

/*
 * outbox_progress_topic_check
 *		Make sure topic can hold the progress records: it exists (created
 *		with one partition and cleanup.policy = compact when missing), has
 *		exactly one partition (records on two could be read back out of
 *		order) and no deletion retention (the last record must never
 *		expire).  Returns NULL if so, else why not (palloc'd); *unavailable
 *		is set when the answer did not come within timeout_ms (ms).
 */
char *
outbox_progress_topic_check(OutboxProducer *producer, const char *topic,
							int timeout_ms, bool *unavailable)
{
	bool		missing = false;
	char	   *refusal;

	*unavailable = false;
	refusal = describe_topic(producer, topic, timeout_ms, &missing, unavailable);
	if (refusal == NULL && missing)
	{
		refusal = create_topic(producer, topic, timeout_ms, unavailable);
		if (refusal == NULL)
			refusal = describe_topic(producer, topic, timeout_ms, &missing,
									 unavailable);
		if (refusal == NULL && missing)
			refusal = psprintf("the progress topic \"%s\" was created but cannot be described", topic);
	}
	if (refusal == NULL)
		refusal = count_partitions(producer, topic, timeout_ms, unavailable);
	return refusal;
}

/*
 * Wait for the result of an admin request on queue, serving the procsignal
 * barriers between steps.  Returns the event if the request succeeded as a
 * whole; else NULL, with *refusal saying "could not <what> the progress
 * topic" and why, and *unavailable set (no answer within timeout_ms, ms, or
 * an error of the whole request).
 */
static rd_kafka_event_t *
admin_wait(rd_kafka_queue_t *queue, const char *what, const char *topic,
		   int timeout_ms, char **refusal, bool *unavailable)
{
	TimestampTz start = GetCurrentTimestamp();
	rd_kafka_event_t *ev;

	while ((ev = rd_kafka_queue_poll(queue, 100)) == NULL &&
		   !TimestampDifferenceExceeds(start, GetCurrentTimestamp(), timeout_ms))
	{
		if (ProcSignalBarrierPending)
			ProcessProcSignalBarrier();
		CHECK_FOR_INTERRUPTS();
	}
	if (ev != NULL && rd_kafka_event_error(ev) == RD_KAFKA_RESP_ERR_NO_ERROR)
		return ev;
	*unavailable = true;
	*refusal = psprintf("could not %s the progress topic \"%s\": %s", what, topic,
						ev ? rd_kafka_event_error_string(ev) : "timed out");
	if (ev != NULL)
		rd_kafka_event_destroy(ev);
	return NULL;
}

/*
 * DescribeConfigs of the topic: *missing if it does not exist, a refusal
 * if its cleanup.policy is not compact.
 */
static char *
describe_topic(OutboxProducer *producer, const char *topic, int timeout_ms,
			   bool *missing, bool *unavailable)
{
	rd_kafka_queue_t *queue = rd_kafka_queue_new(producer->rk);
	rd_kafka_ConfigResource_t *res = rd_kafka_ConfigResource_new(RD_KAFKA_RESOURCE_TOPIC, topic);
	rd_kafka_event_t *ev;
	const rd_kafka_ConfigResource_t **results;
	const rd_kafka_ConfigEntry_t **entries;
	size_t		nresults = 0;
	size_t		nentries = 0;
	char	   *refusal = NULL;
	const char *policy = NULL;

	*missing = false;
	rd_kafka_DescribeConfigs(producer->rk, &res, 1, NULL, queue);
	ev = admin_wait(queue, "describe", topic, timeout_ms, &refusal, unavailable);
	if (ev != NULL)
	{
		results = rd_kafka_DescribeConfigs_result_resources(rd_kafka_event_DescribeConfigs_result(ev),
															&nresults);
		if (nresults != 1 ||
			rd_kafka_ConfigResource_error(results[0]) == RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART)
			*missing = true;
		else if (rd_kafka_ConfigResource_error(results[0]) != RD_KAFKA_RESP_ERR_NO_ERROR)
			refusal = psprintf("could not describe the progress topic \"%s\": %s", topic,
							   rd_kafka_ConfigResource_error_string(results[0]));
		else
		{
			entries = rd_kafka_ConfigResource_configs(results[0], &nentries);
			for (size_t i = 0; i < nentries; i++)
				if (strcmp(rd_kafka_ConfigEntry_name(entries[i]), "cleanup.policy") == 0)
					policy = rd_kafka_ConfigEntry_value(entries[i]);
			if (policy == NULL || strcmp(policy, "compact") != 0)
				refusal = psprintf("the progress topic \"%s\" has cleanup.policy = %s: its records would be deleted when they expire",
								   topic, policy ? policy : "(unknown)");
		}
	}
	if (ev != NULL)
		rd_kafka_event_destroy(ev);
	rd_kafka_ConfigResource_destroy(res);
	rd_kafka_queue_destroy(queue);
	return refusal;
}

/*
 * CreateTopics: one partition, the broker's default replication factor,
 * cleanup.policy = compact.  A topic created meanwhile by another relay is
 * fine.
 */
static char *
create_topic(OutboxProducer *producer, const char *topic, int timeout_ms,
			 bool *unavailable)
{
	rd_kafka_queue_t *queue = rd_kafka_queue_new(producer->rk);
	char		errstr[256];
	rd_kafka_NewTopic_t *nt = rd_kafka_NewTopic_new(topic, 1, -1, errstr, sizeof(errstr));
	rd_kafka_event_t *ev;
	const rd_kafka_topic_result_t **results;
	size_t		nresults = 0;
	char	   *refusal = NULL;

	if (nt == NULL)
	{
		rd_kafka_queue_destroy(queue);
		return psprintf("could not create the progress topic \"%s\": %s", topic, errstr);
	}
	(void) rd_kafka_NewTopic_set_config(nt, "cleanup.policy", "compact");
	rd_kafka_CreateTopics(producer->rk, &nt, 1, NULL, queue);
	ev = admin_wait(queue, "create", topic, timeout_ms, &refusal, unavailable);
	if (ev != NULL)
	{
		results = rd_kafka_CreateTopics_result_topics(rd_kafka_event_CreateTopics_result(ev),
													  &nresults);
		if (nresults == 1 &&
			rd_kafka_topic_result_error(results[0]) != RD_KAFKA_RESP_ERR_NO_ERROR &&
			rd_kafka_topic_result_error(results[0]) != RD_KAFKA_RESP_ERR_TOPIC_ALREADY_EXISTS)
			refusal = psprintf("the progress topic \"%s\" is missing and could not be created: %s",
							   topic, rd_kafka_topic_result_error_string(results[0]));
		else
			ereport(LOG,
					(errmsg("outbox relay: created the progress topic \"%s\" (1 partition, cleanup.policy = compact)",
							topic)));
	}
	if (ev != NULL)
		rd_kafka_event_destroy(ev);
	rd_kafka_NewTopic_destroy(nt);
	rd_kafka_queue_destroy(queue);
	return refusal;
}

/*
 * The topic must have exactly one partition.
 */
static char *
count_partitions(OutboxProducer *producer, const char *topic, int timeout_ms,
				 bool *unavailable)
{
	rd_kafka_topic_t *rkt = rd_kafka_topic_new(producer->rk, topic, NULL);
	const struct rd_kafka_metadata *md = NULL;
	rd_kafka_resp_err_t err;
	char	   *refusal = NULL;

	err = outbox_kafka_metadata(producer->rk, rkt, &md, timeout_ms);
	if (err != RD_KAFKA_RESP_ERR_NO_ERROR || md->topic_cnt != 1)
	{
		*unavailable = true;
		refusal = psprintf("could not read the metadata of the progress topic \"%s\": %s",
						   topic, rd_kafka_err2str(err));
	}
	else if (md->topics[0].partition_cnt != 1)
		refusal = psprintf("the progress topic \"%s\" has %d partitions, not 1: progress records could be read back out of order",
						   topic, md->topics[0].partition_cnt);
	if (md != NULL)
		rd_kafka_metadata_destroy(md);
	rd_kafka_topic_destroy(rkt);
	return refusal;
}
