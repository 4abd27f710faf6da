/*-------------------------------------------------------------------------
 *
 * launcher_inbox.h
 *	  What the launcher knows of a database's inbox worker
 *	  (launcher_inbox.c); part of its LauncherDb (launcher.h).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_LAUNCHER_INBOX_H
#define OUTBOX_LAUNCHER_INBOX_H

#include "postmaster/bgworker.h"
#include "utils/timestamp.h"

typedef struct LauncherInbox
{
	int			slot;			/* index in outbox_shared->slots, or -1 */
	BackgroundWorkerHandle *handle; /* while it runs */
	bool		stopping;		/* we asked it to exit */
	TimestampTz started_at;
	TimestampTz start_after;	/* restart delay after a failure */
	int			failures;		/* unexpected exits in a row */
	bool		idle;			/* the last one found no subscription ... */
	TimestampTz idle_at;		/* ... at this time */
	bool		requested;		/* a subscription committed since */
	bool		allotted;		/* the last share of slots gave it one */
} LauncherInbox;

struct LauncherDb;
struct HTAB;

extern void inbox_launcher_init(struct LauncherDb *db);
extern int	inbox_launcher_allot(List *eligible, int budget, bool first,
								 TimestampTz now);
extern void inbox_launcher_serve(struct LauncherDb *db, TimestampTz now,
								 long *nap);
extern void inbox_launcher_serve_all(List *covered, bool served,
									 TimestampTz now, long *nap);
extern void inbox_launcher_reap(struct LauncherDb *db, TimestampTz now);
extern void inbox_launcher_stop(struct LauncherDb *db);
extern bool inbox_launcher_running(const struct LauncherDb *db);
extern void inbox_launcher_take_requests(struct HTAB *databases);

#endif							/* OUTBOX_LAUNCHER_INBOX_H */
