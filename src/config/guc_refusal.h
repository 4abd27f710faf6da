/*-------------------------------------------------------------------------
 *
 * guc_refusal.h
 *	  Settings refused when the server started: the relay publishes
 *	  nothing while one stands (guc_refusal.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_GUC_REFUSAL_H
#define OUTBOX_GUC_REFUSAL_H

#include "utils/guc.h"

typedef enum OutboxRefusable
{
	OUTBOX_REFUSABLE_KAFKA_PROPERTIES,
	OUTBOX_REFUSABLE_MESSAGE_FORMAT,
	OUTBOX_REFUSABLE_CE_SOURCE,
	/* the inbox's (src/inbox): they stop the inbox, not the relay */
	OUTBOX_REFUSABLE_INBOX_KAFKA_PROPERTIES,
	OUTBOX_NUM_REFUSABLE
} OutboxRefusable;

/* the refusals that stop the relay come before the inbox's */
#define OUTBOX_NUM_RELAY_REFUSABLE	OUTBOX_REFUSABLE_INBOX_KAFKA_PROPERTIES

extern void outbox_note_refusal(OutboxRefusable setting, GucSource source,
								const char *why);
extern void outbox_clear_refusal(OutboxRefusable setting);
extern char *outbox_config_refusal(void);
extern char *outbox_refusal_of(OutboxRefusable setting);
extern void outbox_reload_config_file(void);

#endif							/* OUTBOX_GUC_REFUSAL_H */
