/*-------------------------------------------------------------------------
 *
 * broker_call.c
 *	  Blocking librdkafka requests asked in short steps.
 *
 * rd_kafka_metadata() and rd_kafka_query_watermark_offsets() block the
 * calling thread until a broker answers or their timeout passes; nothing
 * interrupts them.  A broker that stopped answering (frozen, or behind a
 * dropped network) makes each call last its whole timeout, and a worker
 * told to stop (SIGTERM from a fast shutdown or pg_terminate_backend())
 * would only notice after it.  These wrappers ask in steps instead and give
 * up as soon as a stop was asked for (ProcDiePending, set by die() even
 * while interrupts are held), so that the worker's exit waits one step at
 * most.  The steps grow from BROKER_FIRST_STEP_MS to BROKER_LAST_STEP_MS: a
 * broker that answers slowly, but answers, still gets a long enough wait
 * (a fixed short step would ask again and again, each time too early).  A
 * step that times out leaves its request to librdkafka, which drops it with
 * the handle or when the broker answers.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "miscadmin.h"
#include "utils/timestamp.h"

#include "kafka/broker_call.h"

/* the first step, doubled each time up to the last (the longest a stop waits) */
#define BROKER_FIRST_STEP_MS	250
#define BROKER_LAST_STEP_MS		2000

static int	next_step(TimestampTz start, int timeout_ms, int *step);

/*
 * outbox_kafka_metadata
 *		rd_kafka_metadata() for one topic (rkt), or for the brokers and
 *		the topics the handle knows (rkt NULL), waiting at most timeout_ms
 *		(ms).  Returns its error code:
 *		RD_KAFKA_RESP_ERR__TIMED_OUT also when a stop cut the wait short.
 *		On success *md is for rd_kafka_metadata_destroy().
 */
rd_kafka_resp_err_t
outbox_kafka_metadata(rd_kafka_t *rk, rd_kafka_topic_t *rkt,
					  const struct rd_kafka_metadata **md, int timeout_ms)
{
	TimestampTz start = GetCurrentTimestamp();
	rd_kafka_resp_err_t err = RD_KAFKA_RESP_ERR__TIMED_OUT;
	int			step = 0;
	int			wait_ms;

	*md = NULL;
	while (!ProcDiePending && (wait_ms = next_step(start, timeout_ms, &step)) > 0)
	{
		err = rd_kafka_metadata(rk, 0, rkt, md, wait_ms);
		if (err != RD_KAFKA_RESP_ERR__TIMED_OUT)
			break;
	}
	return err;
}

/*
 * outbox_kafka_watermarks
 *		rd_kafka_query_watermark_offsets() of (topic, partition), waiting at
 *		most timeout_ms (ms), in the same steps.
 */
rd_kafka_resp_err_t
outbox_kafka_watermarks(rd_kafka_t *rk, const char *topic, int32_t partition,
						int64_t *low, int64_t *high, int timeout_ms)
{
	TimestampTz start = GetCurrentTimestamp();
	rd_kafka_resp_err_t err = RD_KAFKA_RESP_ERR__TIMED_OUT;
	int			step = 0;
	int			wait_ms;

	while (!ProcDiePending && (wait_ms = next_step(start, timeout_ms, &step)) > 0)
	{
		err = rd_kafka_query_watermark_offsets(rk, topic, partition, low, high,
											   wait_ms);
		if (err != RD_KAFKA_RESP_ERR__TIMED_OUT)
			break;
	}
	return err;
}

/*
 * The next step's wait (ms), *step being the last one (0 before the first):
 * twice the last, between BROKER_FIRST_STEP_MS and BROKER_LAST_STEP_MS, and
 * no more than what is left of timeout_ms; 0 when nothing is left.
 */
static int
next_step(TimestampTz start, int timeout_ms, int *step)
{
	long		secs;
	int			usecs;
	int64		left;

	TimestampDifference(start, GetCurrentTimestamp(), &secs, &usecs);
	left = (int64) timeout_ms - ((int64) secs * 1000 + usecs / 1000);
	if (left <= 0)
		return 0;
	*step = *step == 0 ? BROKER_FIRST_STEP_MS : Min(*step * 2, BROKER_LAST_STEP_MS);
	return (int) Min(left, *step);
}
