/*-------------------------------------------------------------------------
 *
 * relay_xact.h
 *	  The frame every relay transaction runs in (relay_xact.c): open and
 *	  close, the lock on outbox.events, saved plans.
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_RELAY_XACT_H
#define OUTBOX_RELAY_XACT_H

#include "executor/spi.h"

extern MemoryContext outbox_relay_xact_begin(const char *activity);
extern void outbox_relay_xact_end(MemoryContext callercxt, bool report_stats);
extern Oid	outbox_lock_events_table(void);
extern SPIPlanPtr outbox_prepare_bytes_plan(SPIPlanPtr *cache, const char *format,
											bool bytes, int nargs, Oid *argtypes);
extern SPIPlanPtr outbox_prepare_plan(SPIPlanPtr *cache, const char *sql,
									  int nargs, Oid *argtypes);

#endif							/* OUTBOX_RELAY_XACT_H */
