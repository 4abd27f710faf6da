/*-------------------------------------------------------------------------
 *
 * row_message.h
 *	  An event row becomes the fields of a Kafka message (row_message.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_ROW_MESSAGE_H
#define OUTBOX_ROW_MESSAGE_H

#include "kafka/producer.h"

#include "access/htup.h"
#include "access/tupdesc.h"
#include "utils/uuid.h"

/*
 * headers of one message: ours (at most OUTBOX_OWN_HEADERS_MAX), then up to
 * OUTBOX_USER_HEADERS_IN_PLACE of the user's in place
 */
#define OUTBOX_OWN_HEADERS_MAX			8
#define OUTBOX_USER_HEADERS_IN_PLACE	64
#define OUTBOX_CE_TIME_LEN				40

typedef struct OutboxHeaderSpace
{
	const char *names[OUTBOX_USER_HEADERS_IN_PLACE + OUTBOX_OWN_HEADERS_MAX];
	const char *values[OUTBOX_USER_HEADERS_IN_PLACE + OUTBOX_OWN_HEADERS_MAX];
	size_t		lens[OUTBOX_USER_HEADERS_IN_PLACE + OUTBOX_OWN_HEADERS_MAX];
	char		event_id[UUID_LEN * 2 + 5]; /* the id header's value */
	char		ce_time[OUTBOX_CE_TIME_LEN];	/* cloudevents: ce_time */
} OutboxHeaderSpace;

/*
 * A fetched row, deformed once: values[COL_x - 1] and nulls[COL_x - 1].
 */
typedef struct OutboxRow
{
	Datum	   *values;
	bool	   *nulls;
} OutboxRow;

#define ROW_VALUE(row, col)		((row)->values[(col) - 1])
#define ROW_ISNULL(row, col)	((row)->nulls[(col) - 1])

extern void outbox_row_deform(HeapTuple tuple, TupleDesc tupdesc, OutboxRow *row);
extern char *outbox_row_text(const OutboxRow *row, int col);
extern const char *outbox_row_routed_topic(const char *aggregate_type, bool *legal);
extern void outbox_row_build_message(const OutboxRow *row, const char *topic,
									 const char *aggregate_type,
									 const char *aggregate_id,
									 OutboxHeaderSpace *space,
									 OutboxMessage *msg);

#endif							/* OUTBOX_ROW_MESSAGE_H */
