/*-------------------------------------------------------------------------
 *
 * emit.h
 *	  Writing events in the caller's transaction (emit.c), as emit(),
 *	  capture() and the operations functions do.
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_EMIT_H
#define OUTBOX_EMIT_H

#include "utils/jsonb.h"
#include "utils/uuid.h"

typedef struct OutboxEvent
{
	text	   *aggregate_type;
	text	   *aggregate_id;
	text	   *event_type;
	Jsonb	   *payload;		/* NULL: tombstone (or bytes below) */
	bytea	   *payload_bytes;	/* emit_bytes(): the value as is; else NULL */
	Jsonb	   *headers;		/* NULL: none */
	text	   *topic;			/* NULL: routed */
} OutboxEvent;

extern void outbox_validate_topic(text *topic, text *aggregate_type,
								  const char *context);
extern pg_uuid_t *outbox_insert_event(const OutboxEvent *event,
									  const char *context);
extern void outbox_register_wakeup_at_commit(bool control);

#endif							/* OUTBOX_EMIT_H */
