/*-------------------------------------------------------------------------
 *
 * bgworker.h
 *	  What every outbox background worker shares (bgworker.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_BGWORKER_H
#define OUTBOX_BGWORKER_H

#include "postmaster/bgworker.h"

extern void outbox_init_bgworker(BackgroundWorker *worker,
								 const char *function, const char *type,
								 int restart_time);

#endif							/* OUTBOX_BGWORKER_H */
