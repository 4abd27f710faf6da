/*-------------------------------------------------------------------------
 *
 * batch_report.c
 *	  What a relay batch tells, once it ended: its counts and first error go
 *	  to outbox.status (status.c), its dead letters to the log, and its
 *	  outcome decides the relay's state toward Kafka (reachable, down).
 *	  worker.c calls these after each batch.c batch.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "config/guc.h"
#include "kafka/producer.h"
#include "relay/relay.h"
#include "shared/shmem.h"
#include "shared/status.h"
#include "worker/batch.h"

#include "utils/timestamp.h"

/* while Kafka seems down and nothing is pending: how often to ask it */
#define PROBE_INTERVAL_MS		5000
#define PROBE_TIMEOUT_MS		1000

/*
 * outbox_report_batch
 *		Add a batch's counts to outbox.status, record its first error there,
 *		and warn (WARNING, once per batch) about the events it marked failed
 *		and those acknowledged after an earlier event of their aggregate
 *		failed.
 */
void
outbox_report_batch(const OutboxBatchResult *result)
{
	outbox_status_count(result->published, result->dead_lettered,
						result->failed_permanent + result->failed_transient +
						result->failed_unattributed);
	if (result->first_error != NULL)
		outbox_status_set_error(result->first_error);
	if (result->dead_lettered > 0)
		ereport(WARNING,
				(errmsg("outbox relay marked %d event(s) failed: each was refused %d time(s)",
						result->dead_lettered, outbox_max_attempts),
				 errdetail("First error of this batch: %s", result->first_error),
				 errhint("Failed events keep their rows (failed_at is set); SELECT outbox.retry_failed() requeues them.%s",
						 outbox_on_failed_event == OUTBOX_ON_FAILED_HOLD ?
						 " Later events of their aggregates wait behind them (outbox.on_failed_event = hold)." : "")));
	if (result->overtaken > 0)
		ereport(WARNING,
				(errmsg("outbox relay: %d event(s) were acknowledged after an earlier event of the same aggregate failed",
						result->overtaken),
				 errdetail("First failure: %s", result->first_error)));
}

/*
 * outbox_update_broker_state
 *		Set the relay's state (outbox.status) from what the batch that
 *		producer just ran tells about the broker; may ask the broker itself,
 *		waiting up to PROBE_TIMEOUT_MS.
 *
 * Any transient failure means trouble, even if part of the batch was
 * acknowledged before it began; only a batch without one, or an answer to a
 * probe, means Kafka is reachable again.
 */
void
outbox_update_broker_state(OutboxProducer *producer,
						   const OutboxBatchResult *result)
{
	static TimestampTz last_probe = 0;

	if (result->failed_transient > 0 || result->aborted)
		outbox_enter_state(OUTBOX_STATE_BROKER_DOWN,
						   result->first_error ? result->first_error : producer->last_error_text);
	else if (result->published > 0)
	{
		outbox_enter_state(OUTBOX_STATE_PUBLISHING, NULL);
		producer->cause_text[0] = '\0';
	}
	else if (producer->all_brokers_down &&
			 outbox_relay_state() != OUTBOX_STATE_BROKER_DOWN)
	{
		/* librdkafka also says this when an idle connection is closed */
		if (!outbox_producer_probe(producer, PROBE_TIMEOUT_MS))
			outbox_enter_state(OUTBOX_STATE_BROKER_DOWN, producer->last_error_text);
		last_probe = GetCurrentTimestamp();
	}
	else if (outbox_relay_state() == OUTBOX_STATE_BROKER_DOWN && result->claimed == 0 &&
			 TimestampDifferenceExceeds(last_probe, GetCurrentTimestamp(), PROBE_INTERVAL_MS))
	{
		if (outbox_producer_probe(producer, PROBE_TIMEOUT_MS))
			outbox_enter_state(OUTBOX_STATE_IDLE, NULL);
		else if (producer->last_error_text[0] != '\0')
		{
			/* still down, maybe for another reason (a new bootstrap_servers) */
			outbox_status_set_error(producer->last_error_text);
		}
		last_probe = GetCurrentTimestamp();
	}
	else if (outbox_relay_state() != OUTBOX_STATE_BROKER_DOWN)
		outbox_enter_state(result->claimed > 0 ? OUTBOX_STATE_PUBLISHING : OUTBOX_STATE_IDLE, NULL);
	producer->all_brokers_down = false;
}
