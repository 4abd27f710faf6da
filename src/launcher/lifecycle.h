/*-------------------------------------------------------------------------
 *
 * lifecycle.h
 *	  The ProcessUtility hook that tells the launcher about CREATE
 *	  EXTENSION outbox and database DDL, and keeps relays from blocking
 *	  DROP DATABASE (lifecycle.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_LIFECYCLE_H
#define OUTBOX_LIFECYCLE_H

#include "tcop/utility.h"

extern void outbox_install_lifecycle_hook(void);
extern bool outbox_database_blocked(Oid dboid);

#endif							/* OUTBOX_LIFECYCLE_H */
