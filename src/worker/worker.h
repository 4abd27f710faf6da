/*-------------------------------------------------------------------------
 *
 * worker.h
 *	  One relay worker, started by the launcher (launcher/launcher.c) under
 *	  this entry point's name (worker.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_WORKER_H
#define OUTBOX_WORKER_H

extern PGDLLEXPORT void outbox_worker_main(Datum main_arg);

#endif							/* OUTBOX_WORKER_H */
