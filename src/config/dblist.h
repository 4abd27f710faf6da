/*-------------------------------------------------------------------------
 *
 * dblist.h
 *	  The databases of the cluster as the launcher sees them (dblist.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_DBLIST_H
#define OUTBOX_DBLIST_H

#include "outbox.h"

/* one row of pg_database */
typedef struct OutboxDatabase
{
	Oid			oid;
	char		name[NAMEDATALEN];
	bool		allow_connections;	/* datallowconn */
	bool		is_template;	/* datistemplate */
} OutboxDatabase;

extern OutboxDatabase *outbox_scan_databases(int *count);

#endif							/* OUTBOX_DBLIST_H */
