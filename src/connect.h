/*-------------------------------------------------------------------------
 *
 * connect.h
 *	  The relay worker's connection to outbox.database (connect.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_CONNECT_H
#define OUTBOX_CONNECT_H

extern void outbox_connect_to_database(void);

#endif							/* OUTBOX_CONNECT_H */
