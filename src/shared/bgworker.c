/*-------------------------------------------------------------------------
 *
 * bgworker.c
 *	  What every outbox background worker shares: the launcher
 *	  (outbox.c registers it), the relays (launcher/launcher_relays.c) and
 *	  the relay's VACUUM worker (relay/vacuum.c).
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "shared/bgworker.h"

/*
 * outbox_init_bgworker
 *		Fill *worker with what every outbox background worker (launcher,
 *		relay, VACUUM worker) shares: library "outbox", shared memory and a
 *		database connection (the launcher connects to none, but reads
 *		shared catalogs), started once recovery has finished, so never on a
 *		hot standby.
 *
 * function is the entry point, type the backend_type pg_stat_activity
 * shows (also the process name, until the caller sets another), and
 * restart_time in seconds or BGW_NEVER_RESTART.  bgw_main_arg, bgw_extra
 * and bgw_notify_pid are left zero for the caller.  Raises no error.
 */
void
outbox_init_bgworker(BackgroundWorker *worker, const char *function,
					 const char *type, int restart_time)
{
	memset(worker, 0, sizeof(*worker));
	worker->bgw_flags = BGWORKER_SHMEM_ACCESS | BGWORKER_BACKEND_DATABASE_CONNECTION;
	worker->bgw_start_time = BgWorkerStart_RecoveryFinished;
	worker->bgw_restart_time = restart_time;
	snprintf(worker->bgw_library_name, BGW_MAXLEN, "outbox");
	snprintf(worker->bgw_function_name, BGW_MAXLEN, "%s", function);
	snprintf(worker->bgw_name, BGW_MAXLEN, "%s", type);
	snprintf(worker->bgw_type, BGW_MAXLEN, "%s", type);
}
