/*-------------------------------------------------------------------------
 *
 * vacuum.h
 *	  The relay's own VACUUM of outbox.events after retention deletes
 *	  (vacuum.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_VACUUM_H
#define OUTBOX_VACUUM_H

#include "postgres.h"

extern void outbox_vacuum_count_deleted(int64 rows);
extern void outbox_vacuum_if_due(void);
extern PGDLLEXPORT void outbox_vacuum_main(Datum main_arg);

#endif							/* OUTBOX_VACUUM_H */
