/*-------------------------------------------------------------------------
 *
 * outbox.c
 *	  Module entry point of the outbox extension.
 *
 * Loaded through shared_preload_libraries, the library reserves its shared
 * memory and registers the relay worker.  Loaded any other way (the first
 * call of outbox.emit() in a backend, LOAD 'outbox'), it only defines its
 * settings: emit() works, no worker starts.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"

#include "fmgr.h"
#include "miscadmin.h"

PG_MODULE_MAGIC;

void		_PG_init(void);

/*
 * _PG_init
 *		Define the GUCs everywhere; set up shared memory and the relay
 *		worker only when preloaded by the postmaster.
 */
void
_PG_init(void)
{
	outbox_define_gucs();

	if (!process_shared_preload_libraries_in_progress)
		return;

	/* pg_upgrade starts the server only to move catalogs: no relaying */
	if (IsBinaryUpgrade)
		return;

	outbox_check_preload_order();
	outbox_shmem_install_hooks();
	outbox_register_worker();
}
