/*-------------------------------------------------------------------------
 *
 * trace_context.h
 *	  W3C trace context of the events written (trace_context.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_TRACE_CONTEXT_H
#define OUTBOX_TRACE_CONTEXT_H

#include "utils/jsonb.h"

extern bool outbox_traceparent_is_valid(const char *s);
extern bool outbox_tracestate_is_valid(const char *s);
extern void outbox_check_trace_header(const char *key, const char *value,
									  size_t len);
extern Jsonb *outbox_add_trace_context(Jsonb *headers);

#endif							/* OUTBOX_TRACE_CONTEXT_H */
