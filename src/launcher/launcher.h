/*-------------------------------------------------------------------------
 *
 * launcher.h
 *	  What the launcher knows of each covered database (launcher.c) and of
 *	  the relays it runs there (launcher_relays.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_LAUNCHER_H
#define OUTBOX_LAUNCHER_H

#include "outbox.h"

#include "datatype/timestamp.h"
#include "postmaster/bgworker.h"
#include "utils/hsearch.h"
#include "launcher/launcher_inbox.h"

/* '*': a database without the extension is probed again after this long */
#define ABSENT_REPROBE_MS			(5 * 60 * 1000)
/* how long a database runs fewer relays after a background worker was missing */
#define BGW_CAP_MS					(5 * 60 * 1000)

/* one relay of a database: worker j of its k */
typedef struct LauncherRelay
{
	int			slot;			/* index in outbox_shared->slots, or -1 */
	BackgroundWorkerHandle *handle; /* while it runs */
	bool		stopping;		/* we asked it to exit: no restart delay */
	bool		retiring;		/* ... between two batches (slot's retire) */
	TimestampTz stop_asked_at;
	TimestampTz started_at;
	TimestampTz start_after;	/* restart delay */
	int			failures;		/* unexpected exits in a row */
} LauncherRelay;

/* what the launcher knows of one covered (or lately covered) database */
typedef struct LauncherDb
{
	char		name[NAMEDATALEN];	/* hash key */
	Oid			dboid;			/* InvalidOid while it does not exist */
	Oid			roleoid;		/* outbox.role, resolved */
	bool		wanted;			/* covered at the last pass */
	char	   *obstacle;		/* why no relay can connect, or NULL */
	char	   *logged_obstacle;	/* the last one logged */
	bool		absent;			/* '*': no extension there */
	bool		created;		/* CREATE EXTENSION committed since the start */
	TimestampTz absent_at;
	TimestampTz unserved_since; /* no slot for it since; 0: served */
	bool		no_bgworker;	/* why: max_worker_processes, not max_workers */
	int			nworkers;		/* k of the relays that run or start */
	int			allotted;		/* relays the last share of slots gave it */
	bool		confirmed;		/* '*': a relay found the extension there */
	int			bgw_cap;		/* relays that got a background worker ... */
	TimestampTz bgw_cap_until;	/* ... when the next one got none: until */
	bool		short_logged;	/* logged that it runs fewer than wanted */
	bool		new_generation; /* its generation began in this pass */
	bool		start_rest;		/* this pass may start its relays after the first */
	LauncherRelay relays[OUTBOX_MAX_WORKERS_PER_DATABASE];
	LauncherInbox inbox;		/* its inbox worker (src/inbox) */
} LauncherDb;

extern bool launcher_wants_relays(LauncherDb *db, bool all, TimestampTz now);
extern int	launcher_relays_wanted(LauncherDb *db, bool all, TimestampTz now);
extern void launcher_allot_slots(List *covered, bool all, TimestampTz now);
extern void launcher_init_relays(LauncherDb *db);
extern int	launcher_relays_running(const LauncherDb *db);
extern void launcher_reap_relays(LauncherDb *db, TimestampTz now);
extern void launcher_stop_relays(LauncherDb *db);
extern bool launcher_retire_relays(LauncherDb *db, TimestampTz now);
extern bool launcher_start_relay(LauncherDb *db, int worker, HTAB *databases,
								 TimestampTz now);
extern bool launcher_relay_found_extension(const LauncherDb *db);
extern bool launcher_needs_relay(const LauncherDb *db, bool all);
extern void launcher_give_up_relay(LauncherDb *needy, List *covered,
								   HTAB *databases, TimestampTz now);
extern int	launcher_take_slot(LauncherDb *db, int worker);
extern void launcher_free_slot(LauncherDb *db, int worker);
extern void launcher_free_idle_slots(LauncherDb *db, int worker);

/* the launcher's entry point (launcher.c), registered by outbox.c */
extern PGDLLEXPORT void outbox_launcher_main(Datum main_arg);

#endif							/* OUTBOX_LAUNCHER_H */
