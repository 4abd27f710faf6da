/*-------------------------------------------------------------------------
 *
 * status.h
 *	  The relay's state machine as seen from outside: its state, logged
 *	  once per change, its counters and its last error.
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_STATUS_H
#define OUTBOX_STATUS_H

#include "shared/shmem.h"

extern void outbox_enter_state(OutboxRelayState new_state, const char *error);
extern OutboxRelayState outbox_relay_state(void);
extern void outbox_status_set_error(const char *error);
extern void outbox_status_slot(OutboxRelaySlot *slot, pid_t pid,
							   OutboxRelayState state, const char *error);
extern void outbox_status_count(int64 published, int64 failed,
								int64 delivery_errors);
extern void outbox_status_refused(OutboxRelaySlot *slot, const char *dbname,
								  int delay_ms);
extern void outbox_status_unserved(const OutboxUnserved *list, int count);

#endif							/* OUTBOX_STATUS_H */
