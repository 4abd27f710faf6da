/*-------------------------------------------------------------------------
 *
 * outbox.c
 *	  Module entry point of the outbox extension.
 *
 * Loaded through shared_preload_libraries, the library reserves its shared
 * memory, installs the hook that tells the launcher about CREATE EXTENSION
 * and database DDL, and registers the launcher, which starts the relays.  Loaded any other way (the first
 * call of outbox.emit() in a backend, LOAD 'outbox'), it only defines its
 * settings and installs the hooks that keep their secrets out of view:
 * emit() works, no worker starts.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "config/guc.h"
#include "config/secrets.h"
#include "launcher/lifecycle.h"
#include "shared/bgworker.h"
#include "shared/shmem.h"

#include "fmgr.h"
#include "miscadmin.h"
#include "postmaster/bgworker.h"

PG_MODULE_MAGIC;

/* seconds the postmaster waits before restarting a launcher that exited */
#define LAUNCHER_RESTART_SECONDS	1

void		_PG_init(void);
static void outbox_register_launcher(void);

/*
 * _PG_init
 *		Define the GUCs and install the secret-keeping hooks everywhere; set
 *		up shared memory, the lifecycle hook and the launcher only when
 *		preloaded by the postmaster.
 */
void
_PG_init(void)
{
	outbox_define_gucs();

	/*
	 * Install hooks.  In every process that loads the library, preloaded or
	 * not, keep the secrets of outbox.kafka_properties out of the server log
	 * and out of pg_stat_activity and pg_stat_statements (secrets.c).
	 */
	outbox_prev_emit_log_hook = emit_log_hook;
	emit_log_hook = outbox_emit_log_hook;
	outbox_prev_process_utility_hook = ProcessUtility_hook;
	ProcessUtility_hook = outbox_process_utility;

	if (!process_shared_preload_libraries_in_progress)
		return;

	/* pg_upgrade starts the server only to move catalogs: no relaying */
	if (IsBinaryUpgrade)
		return;

	outbox_check_preload_order();

	/*
	 * Install hooks.  In the postmaster only: shared memory for the relay's
	 * status and wake-up latch (shmem.c).
	 */
	outbox_prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = outbox_shmem_request;
	outbox_prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = outbox_shmem_startup;

	outbox_install_lifecycle_hook();
	outbox_register_launcher();
}

/*
 * outbox_register_launcher
 *		Register the launcher (launcher.c) with the postmaster.  Called from
 *		_PG_init under shared_preload_libraries only.
 *
 * It starts only once recovery has finished, so never on a hot standby,
 * and by itself after promotion.
 */
static void
outbox_register_launcher(void)
{
	BackgroundWorker worker;

	outbox_init_bgworker(&worker, "outbox_launcher_main", "outbox launcher",
						 LAUNCHER_RESTART_SECONDS);
	RegisterBackgroundWorker(&worker);
}
