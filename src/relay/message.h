/*-------------------------------------------------------------------------
 *
 * message.h
 *	  The batch being produced, shared by the relay's files (batch.c,
 *	  message.c, mark.c): its entries, the columns a claimed row has, and
 *	  how a row is produced (message.c; its message is built in
 *	  row_message.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_MESSAGE_H
#define OUTBOX_MESSAGE_H

#include "kafka/producer.h"

#include "storage/itemptr.h"
#include "utils/portal.h"

/*
 * Column numbers of a claimed row: of the claim (batch.c) and of the
 * snapshot batch's EVENT_COLUMNS (snapshot.c), which list the same columns.
 */
enum
{
	COL_ID = 1,
	COL_EVENT_ID,
	COL_AGGREGATE_TYPE,
	COL_AGGREGATE_ID,
	COL_EVENT_TYPE,
	COL_TOPIC,
	COL_PAYLOAD,
	COL_HEADERS,
	COL_CREATED_AT,
	COL_ATTEMPTS,
	COL_PAYLOAD_BYTES,			/* NULL::bytea before schema 1.6 */
	COL_CTID
};

/* what the relay remembers about each claimed row until it is marked */
typedef struct BatchEntry
{
	int64		id;
	ItemPointerData ctid;		/* of the row as claimed (and locked) */
	uint64		aggregate_hash; /* hash of (aggregate_type, aggregate_id) */
	int32		attempts;
	bool		produced;		/* handed to librdkafka */
	bool		held_back;		/* not produced: its aggregate failed earlier
								 * in this batch */
	bool		overtook;		/* acknowledged after an earlier event of its
								 * aggregate failed */
	bool		barrier;		/* produced, but later events of its aggregate
								 * wait for its report (see BARRIER_BYTES) */
	bool		isolated;		/* produced alone: a refusal is its own */
	rd_kafka_resp_err_t error;	/* failure raised before producing */
	char	   *error_text;
} BatchEntry;

/* the batch being produced */
typedef struct Batch
{
	BatchEntry *entries;
	int			n;				/* rows claimed so far */
	struct HTAB *blocked;		/* aggregates (hashes) with a row that failed
								 * before producing, was held back, or is a
								 * barrier: their later rows wait; or NULL */
	bool		no_isolation;	/* waiting for reports failed: hold back
								 * suspects until the next batch */
	MemoryContext cxt;			/* lives until the batch is marked */
	struct HTAB *held;			/* snapshot batch: aggregates waiting behind
								 * a row-tracked event (snapshot.c), or NULL */
	Oid			events_relid;	/* outbox.events, locked for the transaction */
} Batch;

/*
 * Why outbox_fetch_and_produce stopped.  Only OUTBOX_FETCH_DRY says that the
 * cursor has no more rows: a batch may count as complete (a snapshot batch
 * as exhausted) after nothing but that.  "Stopped early" is never "done".
 */
typedef enum OutboxFetchStop
{
	OUTBOX_FETCH_DRY,			/* the cursor returned its last row */
	OUTBOX_FETCH_FULL,			/* the batch holds outbox.batch_size rows */
	OUTBOX_FETCH_FATAL,			/* the producer hit a fatal error */
	OUTBOX_FETCH_SHUTDOWN		/* SIGTERM arrived (ProcDiePending) */
} OutboxFetchStop;

extern OutboxFetchStop outbox_fetch_and_produce(OutboxProducer *producer,
												Batch *batch, Portal portal,
												MemoryContext rowcxt,
												int *fetched);
extern rd_kafka_resp_err_t outbox_send_with_backpressure(OutboxProducer *producer,
														 int index,
														 const OutboxMessage *msg);
extern bool outbox_wait_for_deliveries(OutboxProducer *producer);
extern void outbox_set_suspect(int64 id, bool suspect);

#endif							/* OUTBOX_MESSAGE_H */
