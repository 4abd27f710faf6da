/*-------------------------------------------------------------------------
 *
 * message.c
 *	  A claimed row becomes a Kafka message: read the row, decide whether it
 *	  must wait behind its aggregate, build the message (row_message.c),
 *	  send it with backpressure; and wait for the delivery reports of a
 *	  batch.
 *
 * How per-aggregate order is kept (the one description; the code it names
 * refers here):
 *	- Rows are claimed in id order (batch.c) and produced in that order.
 *	  librdkafka's idempotent producer keeps each partition in order through
 *	  its own retries, and one aggregate id always maps to one partition
 *	  (murmur2 on the key).
 *	- Hold-back in the claim (batch.c): an event is not claimed while an
 *	  earlier failed event of its aggregate cannot be sent yet (in its
 *	  backoff, or marked failed with on_failed_event = hold): the NOT IN of
 *	  the claim.  So later events cannot overtake a failed one on a later
 *	  attempt.
 *	- Hold-back in the batch (must_wait_behind_aggregate): once a row of an
 *	  aggregate failed before reaching librdkafka in this batch, was held
 *	  back, or is a barrier, its later rows are not produced and wait for
 *	  the next claim.
 *	- Barriers (BARRIER_BYTES): a retried or a large event may be refused
 *	  by the broker.  librdkafka then stops (gapless guarantee), but a later
 *	  batch of the same partition may already be on the wire; so the rest of
 *	  its aggregate waits for the next claim, which comes right after.
 *	- Suspects: a broker refuses a partition's whole record batch, so a
 *	  refusal shared by several events is not known to be any one's own
 *	  (mark.c).  Such an event is a suspect and goes out alone next time.
 *	- Overtaken check (mark.c): an event acknowledged after an earlier
 *	  failed event of its aggregate should not exist; it is counted.
 *	- Snapshot batches (relay v2, snapshot.c): an event tracked by snapshot
 *	  whose aggregate has a pending row-tracked event is held back (the held
 *	  set, batch->held).  Events of a snapshot batch that failed or were held
 *	  back are demoted to row tracking (relay_snapshot_batch in batch.c), and
 *	  the row-tracked claim stays below the snapshot progress's id floor while
 *	  snapshot-tracked events exist, so the two kinds never pass each other.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "relay/message.h"
#include "config/guc.h"
#include "config/topic.h"
#include "kafka/producer.h"
#include "relay/fault_point.h"
#include "relay/row_message.h"
#include "relay/snapshot.h"
#include "shared/shmem.h"
#include "shared/status.h"

#include "executor/spi.h"
#include "miscadmin.h"
#include "postmaster/interrupt.h"
#include "storage/latch.h"
#include "storage/procsignal.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

/* rows fetched from the claim cursor at a time */
#define CLAIM_FETCH_SIZE	256

/*
 * Events larger than this (value and key, bytes) are produced as barriers:
 * later events of the same aggregate wait for the next claim.  Brokers refuse
 * messages by size per topic (max.message.bytes, 1 MiB by default); small
 * events are never refused for it.
 */
#define BARRIER_BYTES	65536

/*
 * Events that were refused together with others (see mark.c): ids, kept
 * until the event is published or marked failed.  Such an event is produced
 * alone next time, so that a refusal is known to be its own.
 */
static HTAB *suspects = NULL;

static void produce_row(OutboxProducer *producer, Batch *batch,
						HeapTuple tuple, TupleDesc tupdesc);
static void read_claimed_row(BatchEntry *entry, const OutboxRow *row,
							 char **aggregate_type, char **aggregate_id);
static bool must_wait_behind_aggregate(OutboxProducer *producer, Batch *batch,
									   BatchEntry *entry);
static OutboxFetchStop fetch_stop(OutboxProducer *producer, Batch *batch);
static void entry_failed(Batch *batch, BatchEntry *entry,
						 rd_kafka_resp_err_t err, const char *text);
static void block_aggregate(Batch *batch, uint64 aggregate_hash);
static bool is_suspect(int64 id);
static void absorb_barriers(void);

/*
 * outbox_fetch_and_produce
 *		Fetch every row of portal and produce it, CLAIM_FETCH_SIZE rows at a
 *		time, so that a batch of large payloads never sits in memory at once:
 *		each row is copied into librdkafka's queue (which is bounded, see
 *		kafka_config.c) and its SPI copy freed with the chunk.
 *
 * Each row becomes entry batch->n of the batch.  Stops when the cursor ran
 * dry, the batch is full, the producer hit a fatal error, or SIGTERM
 * arrived, and returns which (OutboxFetchStop): only the first means the
 * cursor has no more rows.  Closes the portal and sets *fetched to the
 * number of rows fetched.  rowcxt is reset after each row.  SPI errors are
 * raised as ERROR.
 */
OutboxFetchStop
outbox_fetch_and_produce(OutboxProducer *producer, Batch *batch,
						 Portal portal, MemoryContext rowcxt, int *fetched)
{
	OutboxFetchStop stop;

	*fetched = 0;
	for (;;)
	{
		uint64		i;

		if ((stop = fetch_stop(producer, batch)) != OUTBOX_FETCH_DRY)
			break;
		SPI_cursor_fetch(portal, true, CLAIM_FETCH_SIZE);
		if (SPI_processed == 0)
			break;				/* stop is OUTBOX_FETCH_DRY */
		for (i = 0; i < SPI_processed &&
			 fetch_stop(producer, batch) == OUTBOX_FETCH_DRY; i++)
		{
			MemoryContext oldcxt = MemoryContextSwitchTo(rowcxt);

			produce_row(producer, batch, SPI_tuptable->vals[i],
						SPI_tuptable->tupdesc);
			batch->n++;
			(*fetched)++;
			MemoryContextSwitchTo(oldcxt);
			MemoryContextReset(rowcxt);
		}
		SPI_freetuptable(SPI_tuptable);
		/* a test hook: a chunk is produced, the cursor may hold more */
		outbox_fault_point("mid_cursor");
	}
	SPI_cursor_close(portal);
	return stop;
}

/*
 * Must the fetch stop before the next row, and why?  OUTBOX_FETCH_DRY here
 * means "go on": the cursor alone can say that it ran dry.
 */
static OutboxFetchStop
fetch_stop(OutboxProducer *producer, Batch *batch)
{
	if (ProcDiePending)
		return OUTBOX_FETCH_SHUTDOWN;
	if (producer->fatal)
		return OUTBOX_FETCH_FATAL;
	if (batch->n >= outbox_batch_size)
		return OUTBOX_FETCH_FULL;
	return OUTBOX_FETCH_DRY;
}

/*
 * Turn one claimed row into a Kafka message and produce it as entry
 * batch->n of the batch.
 *
 * A row is not produced when an earlier row of the same aggregate failed
 * before reaching librdkafka in this batch (held back, to keep order), or
 * when it cannot be produced at all (illegal routed topic, message too
 * large, ...): then entry->error records why.
 */
static void
produce_row(OutboxProducer *producer, Batch *batch, HeapTuple tuple,
			TupleDesc tupdesc)
{
	int			index = batch->n;
	BatchEntry *entry = &batch->entries[index];
	OutboxMessage msg;
	OutboxHeaderSpace space;
	OutboxRow	row;
	char	   *aggregate_type;
	char	   *aggregate_id;
	const char *topic;
	bool		legal;
	rd_kafka_resp_err_t err;

	outbox_row_deform(tuple, tupdesc, &row);

	read_claimed_row(entry, &row, &aggregate_type, &aggregate_id);
	if (must_wait_behind_aggregate(producer, batch, entry))
		return;

	topic = outbox_row_text(&row, COL_TOPIC);
	if (topic == NULL)
		topic = outbox_row_routed_topic(aggregate_type, &legal);
	else
		legal = outbox_topic_is_legal(topic, strlen(topic));
	if (!legal)
	{
		entry_failed(batch, entry, RD_KAFKA_RESP_ERR_TOPIC_EXCEPTION,
					 psprintf("\"%s\" is not a legal Kafka topic name", topic));
		return;
	}
	/* emit() refuses it too; an older row or a changed prefix may still name it */
	if (strcmp(topic, outbox_progress_topic) == 0)
	{
		entry_failed(batch, entry, RD_KAFKA_RESP_ERR_TOPIC_EXCEPTION,
					 psprintf("\"%s\" is the relay's progress topic (outbox.progress_topic)", topic));
		return;
	}
	outbox_row_build_message(&row, topic, aggregate_type, aggregate_id, &space, &msg);

	err = outbox_send_with_backpressure(producer, index, &msg);
	if (err == RD_KAFKA_RESP_ERR__QUEUE_FULL)
		return;					/* not produced: no verdict, sent again */
	if (err == RD_KAFKA_RESP_ERR_NO_ERROR)
	{
		entry->produced = true;

		/*
		 * A retried event, or a large one, may be refused by the broker.
		 * librdkafka then stops (gapless guarantee), but a later batch of
		 * the same partition may already be on the wire and be written.  So
		 * the rest of this aggregate waits for the next claim, which comes
		 * right after this one; other aggregates are not affected.
		 */
		if (entry->attempts > 0 || msg.value_len + msg.key_len > BARRIER_BYTES)
		{
			entry->barrier = true;
			block_aggregate(batch, entry->aggregate_hash);
		}
		if (entry->isolated)
			(void) outbox_wait_for_deliveries(producer);
	}
	else if (err != RD_KAFKA_RESP_ERR__FATAL)
		entry_failed(batch, entry, err, psprintf("%s (%s)", rd_kafka_err2str(err),
												 rd_kafka_err2name(err)));
	/* on _FATAL the row is left alone; the producer is rebuilt */
}

/*
 * Fill entry with the id, attempts, ctid and aggregate hash of a claimed
 * row, and return its aggregate type and id.
 */
static void
read_claimed_row(BatchEntry *entry, const OutboxRow *row,
				 char **aggregate_type, char **aggregate_id)
{
	entry->id = DatumGetInt64(ROW_VALUE(row, COL_ID));
	entry->attempts = DatumGetInt32(ROW_VALUE(row, COL_ATTEMPTS));
	entry->ctid = *((ItemPointer) DatumGetPointer(ROW_VALUE(row, COL_CTID)));
	*aggregate_type = outbox_row_text(row, COL_AGGREGATE_TYPE);
	*aggregate_id = outbox_row_text(row, COL_AGGREGATE_ID);
	entry->aggregate_hash = outbox_aggregate_hash(*aggregate_type, *aggregate_id);
}

/*
 * Must this row wait for a later claim to keep its aggregate's order (see
 * the file header)?  If so, it is marked held back and true returned.  A
 * suspect that may go out is marked isolated: every message produced
 * before it has its report by now.
 */
static bool
must_wait_behind_aggregate(OutboxProducer *producer, Batch *batch,
						   BatchEntry *entry)
{
	/* tracked by snapshot, behind a pending row-tracked event: wait */
	if (batch->held != NULL &&
		hash_search(batch->held, &entry->aggregate_hash, HASH_FIND, NULL) != NULL)
	{
		entry->held_back = true;
		block_aggregate(batch, entry->aggregate_hash);
		return true;
	}

	/*
	 * Keep order: once a row of this aggregate failed in this batch, or was
	 * held back, or is a barrier, its later rows wait for the next claim.  A
	 * hash collision only delays an unrelated aggregate by one batch.  A set,
	 * not a look back over the batch: after an outage a batch of 100,000
	 * rows behind one such row made that look back quadratic.
	 */
	if (batch->blocked != NULL &&
		hash_search(batch->blocked, &entry->aggregate_hash, HASH_FIND, NULL) != NULL)
	{
		entry->held_back = true;
		return true;
	}

	/*
	 * A suspect goes out alone: every message produced before it has its
	 * report first, and it has its own before the next is produced.
	 */
	if (is_suspect(entry->id))
	{
		if (batch->no_isolation || !outbox_wait_for_deliveries(producer) ||
			producer->fatal)
		{
			batch->no_isolation = true;
			entry->held_back = true;
			block_aggregate(batch, entry->aggregate_hash);
			return true;
		}
		entry->isolated = true;
	}
	return false;
}

/*
 * outbox_send_with_backpressure
 *		Hand msg to librdkafka as message index of the batch.  A full local
 *		queue is backpressure: serve reports and try again.
 *
 * Returns librdkafka's verdict, or RD_KAFKA_RESP_ERR__QUEUE_FULL when
 * SIGTERM arrived while the queue was full (not produced: no verdict, the
 * message is sent again by a later batch).  Raises no ERROR.
 */
rd_kafka_resp_err_t
outbox_send_with_backpressure(OutboxProducer *producer, int index,
					   const OutboxMessage *msg)
{
	rd_kafka_resp_err_t err;

	while ((err = outbox_producer_send(producer, index, msg)) ==
		   RD_KAFKA_RESP_ERR__QUEUE_FULL)
	{
		(void) WaitLatchOrSocket(NULL, WL_SOCKET_READABLE | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
								 producer->wakeup_fd[0], 100,
								 outbox_wait_event(OUTBOX_WAIT_QUEUE_FULL));
		outbox_producer_serve(producer);
		absorb_barriers();
		if (ProcDiePending)
			break;
	}
	return err;
}

/*
 * outbox_wait_for_deliveries
 *		Wait until every message of the batch has its delivery report.
 *
 * librdkafka guarantees a report within message.timeout.ms
 * (outbox.delivery_timeout).  We give up earlier only on a fatal producer
 * error, past a safety margin, or when a reload is pending while nothing
 * moves (e.g. new bootstrap servers while the old ones are unreachable).
 * Returns false when the batch should be aborted.  Raises no ERROR of its
 * own: the caller holds interrupts (see outbox_relay_batch), so the
 * CHECK_FOR_INTERRUPTS below does not end the batch.
 *
 * A latch set by a committing backend while we wait is not lost: it is set
 * again on return, so the worker goes straight to the next claim.
 */
bool
outbox_wait_for_deliveries(OutboxProducer *producer)
{
	TimestampTz start = GetCurrentTimestamp();
	TimestampTz last_progress = start;
	int			last_outstanding = producer->outstanding;
	bool		woken = false;
	bool		complete = false;

	/*
	 * Events are on their way: the relay is publishing, not idle, for as
	 * long as Kafka takes to acknowledge them (up to delivery_timeout when a
	 * broker hangs).  Only idle turns into publishing here: broker_down stays
	 * until a batch tells otherwise (batch_report.c).
	 */
	if (producer->outstanding > 0 && outbox_relay_state() == OUTBOX_STATE_IDLE)
		outbox_enter_state(OUTBOX_STATE_PUBLISHING, NULL);

	for (;;)
	{
		TimestampTz now;
		int			rc;

		outbox_producer_serve(producer);
		absorb_barriers();
		if (producer->outstanding <= 0)
		{
			complete = true;
			break;
		}
		if (producer->fatal || ProcDiePending)
			break;
		if (producer->all_brokers_down)
			outbox_enter_state(OUTBOX_STATE_BROKER_DOWN, producer->last_error_text);

		now = GetCurrentTimestamp();
		if (producer->outstanding != last_outstanding)
		{
			last_outstanding = producer->outstanding;
			last_progress = now;
		}
		if (TimestampDifferenceExceeds(start, now, outbox_delivery_timeout + 10000))
			break;
		if (ConfigReloadPending &&
			TimestampDifferenceExceeds(last_progress, now, 1000))
			break;

		rc = WaitLatchOrSocket(MyLatch,
							   WL_LATCH_SET | WL_SOCKET_READABLE | WL_TIMEOUT |
							   WL_EXIT_ON_PM_DEATH,
							   producer->wakeup_fd[0], 100,
							   outbox_wait_event(OUTBOX_WAIT_DELIVERY));
		if (rc & WL_LATCH_SET)
		{
			ResetLatch(MyLatch);
			woken = true;
			CHECK_FOR_INTERRUPTS();
		}
	}
	if (woken)
		SetLatch(MyLatch);
	return complete;
}

/*
 * Absorb pending procsignal barriers while a batch holds interrupts (see
 * outbox_relay_batch): DROP DATABASE of another database, among others,
 * waits until every process has, and must not wait for Kafka.
 */
static void
absorb_barriers(void)
{
	if (ProcSignalBarrierPending)
		ProcessProcSignalBarrier();
}

/*
 * Is this event a suspect (refused together with others, see mark.c)?
 */
static bool
is_suspect(int64 id)
{
	/* called for every claimed row: the set is empty nearly always */
	if (suspects == NULL || hash_get_num_entries(suspects) == 0)
		return false;
	return hash_search(suspects, &id, HASH_FIND, NULL) != NULL;
}

/*
 * outbox_set_suspect
 *		Make an event a suspect, or no longer one (mark.c decides).
 *
 * The set lives in TopMemoryContext and only ever holds events refused in a
 * shared request that were not published or marked failed since; a restart
 * forgets it, which costs such an event one more shared attempt that does
 * not count.  Raises no error of its own (out of memory aside).
 */
void
outbox_set_suspect(int64 id, bool suspect)
{
	if (suspects == NULL)
	{
		HASHCTL		ctl;

		if (!suspect)
			return;
		ctl.keysize = sizeof(int64);
		ctl.entrysize = sizeof(int64);
		ctl.hcxt = TopMemoryContext;
		suspects = hash_create("outbox relay suspects", 64, &ctl,
							   HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	}
	(void) hash_search(suspects, &id, suspect ? HASH_ENTER : HASH_REMOVE, NULL);
}

/*
 * Record a failure that happened before the row reached librdkafka.
 */
static void
entry_failed(Batch *batch, BatchEntry *entry, rd_kafka_resp_err_t err,
			 const char *text)
{
	entry->error = err;
	entry->error_text = MemoryContextStrdup(batch->cxt, text);
	block_aggregate(batch, entry->aggregate_hash);
}

/*
 * Later rows of this aggregate wait for the next claim (must_wait_behind_
 * aggregate): add its hash to the batch's set, made on first use in the
 * batch's memory context.
 */
static void
block_aggregate(Batch *batch, uint64 aggregate_hash)
{
	if (batch->blocked == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(uint64);
		ctl.entrysize = sizeof(uint64);
		ctl.hcxt = batch->cxt;
		batch->blocked = hash_create("outbox relay blocked aggregates", 64, &ctl,
									 HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	}
	(void) hash_search(batch->blocked, &aggregate_hash, HASH_ENTER, NULL);
}
